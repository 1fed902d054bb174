"""What a device can do: a matmul probe of this machine's devices, and published peaks for
planning runs on GPUs that are not here. Every figure says which it is (`source`).

The probe times square matmuls per dtype for ~0.3 s (after a warm-up) and keeps the best
rate; it runs once per device name, dtype and thread count, and is cached in `peaks.json` in
`data.cache_dir` (~/.cache/dflash by default; `DFLASH_PEAKS` names another file). A probe is
the device's achievable matmul rate, not its datasheet: MFU against it says how far a stage is
from what this device's matmuls do.

The table holds vendors' dense (no sparsity) tensor-core peaks: bf16/fp16 and fp32 (fp32:
the non-tensor-core rate, what PyTorch's default matmul precision gets), and memory.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.store.atomic import atomic_path

__all__ = ["GPUS", "GpuSpec", "Peak", "device_name", "gpu_spec", "peaks_of", "probe_bandwidth", "probe_peak"]


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_tflops: float  # dense
    fp32_tflops: float
    memory_gib: float

    def tflops(self, dtype: str) -> float:
        return self.fp32_tflops if dtype == "float32" else self.bf16_tflops


# Published dense peaks (vendors' datasheets, SXM / OAM parts).
GPUS = {
    "a100": GpuSpec("NVIDIA A100 80GB SXM", 312.0, 19.5, 80e9 / 2**30),
    "h100": GpuSpec("NVIDIA H100 SXM", 989.4, 66.9, 80e9 / 2**30),
    "h200": GpuSpec("NVIDIA H200 SXM", 989.4, 66.9, 141e9 / 2**30),
    "b200": GpuSpec("NVIDIA B200", 2250.0, 75.0, 180e9 / 2**30),
    "mi300x": GpuSpec("AMD Instinct MI300X", 1307.4, 163.4, 192e9 / 2**30),
}


def gpu_spec(name: str) -> GpuSpec:
    """A table entry by its key or a device name containing it (`NVIDIA H100 80GB HBM3`)."""
    key = name.lower().replace(" ", "").replace("-", "")
    for k, spec in GPUS.items():
        if key == k or k in key:
            return spec
    msg = f"unknown GPU {name!r}: one of {', '.join(GPUS)}"
    raise KeyError(msg)


@dataclass(frozen=True)
class Peak:
    tflops: float
    source: str  # "probe" (measured here) or "table" (published)
    device: str  # the device's name
    dtype: str


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        import platform

        return platform.processor() or platform.machine()
    return device.type


def _cache_path(cache_dir: str = "") -> Path:
    """`DFLASH_PEAKS`, else peaks.json in `data.cache_dir` (default ~/.cache/dflash)."""
    if os.environ.get("DFLASH_PEAKS"):
        return Path(os.environ["DFLASH_PEAKS"])
    return Path(cache_dir or "~/.cache/dflash").expanduser() / "peaks.json"


_SIZE = {False: 1024, True: 4096}  # the probe's square matmul: on a CPU, on a GPU


def _measure(device: torch.device, dtype: torch.dtype, seconds: float) -> float:  # no-sync: set-up, once
    n = _SIZE[device.type == "cuda"]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up
    best, rounds, start = 0.0, 1, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sync()  # no-sync: set-up, the probe
        t0 = time.perf_counter()
        for _ in range(rounds):
            torch.mm(a, b)
        sync()  # no-sync: set-up, the probe
        dt = time.perf_counter() - t0
        best = max(best, 2.0 * n**3 * rounds / dt / 1e12)
        if dt < seconds / 8:
            rounds *= 2
    return best


def probe_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.3, cache_dir: str = "") -> Peak:
    """This device's matmul rate in `dtype` (TFLOP/s), measured once and cached."""
    name = device_name(device)
    dt = str(dtype).removeprefix("torch.")
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    key = f"{name}|{dt}|threads={threads}|torch={torch.__version__}|mm={_SIZE[device.type == 'cuda']}"
    path = _cache_path(cache_dir)
    hit = _read_cache(path).get(key)
    if hit is not None:
        return Peak(**hit)
    peak = Peak(round(_measure(device, dtype, seconds), 4), "probe", name, dt)
    _store(path, key, asdict(peak))
    return peak


def probe_bandwidth(device: torch.device, seconds: float = 0.2, cache_dir: str = "") -> float:  # no-sync: set-up, once
    """This device's memory bandwidth (GB/s) for an elementwise pass (a + b -> c, 64 MiB
    each), measured once and cached beside the peaks."""
    name = f"{device_name(device)}|bandwidth|threads={torch.get_num_threads() if device.type == 'cpu' else 0}"
    path = _cache_path(cache_dir)
    hit = _read_cache(path).get(name)
    if hit is not None:
        return float(hit)
    n = 16 * 2**20
    a, b, c = (torch.randn(n, device=device) for _ in range(3))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.add(a, b, out=c)
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sync()  # no-sync: set-up, the probe
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        sync()  # no-sync: set-up, the probe
        best = max(best, 3 * 4 * n / (time.perf_counter() - t0) / 1e9)
    _store(path, name, round(best, 2))
    return best


def _read_cache(path: Path) -> dict:  # type: ignore[type-arg]
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _store(path: Path, key: str, value: Any) -> None:
    """One entry added to the cache file (rewritten atomically); unwritable: measured again next time."""
    cached = _read_cache(path)
    cached[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, durable=False) as tmp:
            tmp.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass


def peaks_of(targets: list, replicas: list, cache_dir: str = "") -> dict[str, Peak]:  # type: ignore[type-arg]
    """The probe's peak of every device a run computes on, in the dtype its matmuls run in:
    the target's; a replica's bf16 on a GPU (autocast) and on a CPU fed bf16 features, else
    float32. One entry a device (the first model there sets the dtype)."""
    out: dict[str, Peak] = {}
    for t in targets:
        if getattr(t, "model", None) is not None:  # the decoder layers run here (not a head-only target)
            dev = t.embed_weight.device
            out.setdefault(str(dev), probe_peak(dev, t.embed_weight.dtype, cache_dir=cache_dir))
    for r in replicas:
        feat = targets[0].embed_weight.dtype if targets else torch.float32
        low = r.device.type == "cuda" or feat == torch.bfloat16
        dtype = torch.bfloat16 if low else torch.float32
        out.setdefault(str(r.device), probe_peak(r.device, dtype, cache_dir=cache_dir))
    return out
