"""The GPU check: every CUDA path of dflash, against its CPU references, and the figures that
say how well one GPU is used. One script, within a time budget (`GPU_CHECK_BUDGET_S`).

    make gpu-wheels                     # on a machine with internet: wheels/ (ignored by git)
    bash bench/gpu_ready.sh             # every check that can run before a GPU lease: READY
    bash bench/gpu_check.sh             # on the GPU machine, from the repository root
    DRY_RUN=1 bash bench/gpu_check.sh   # on CPU, tiny shapes, the same code

`bench/gpu_check.sh` installs from wheels/ what the machine's python lacks and runs this file
with PYTHONPATH=. (no install of dflash). Every check prints one line, `PASS <name> <detail>`
or `FAIL <name> <detail>` (a crash is a FAIL line with its one-line error, and the script
goes on); in a dry run the checks that need CUDA print `SKIP <name> (no CUDA)`, after running
on CPU what they can. Every measure prints `MEASURE <name> <figures>`, with its target where
it has one. Each line ends with the seconds since the start. The last line is one JSON
object, `{"bench": "gpu_check", ...}`, with every figure and verdict; it is also written to
$OUT/gpu_check.json (else runs/gpu_check/), after each line as it goes. The runs' folders, the
bench traces and reports go to --work (default: the same folder; gpu_check.sh keeps them out of
$OUT and packs them into one runs.tar.gz there). Exit status 1 when a check or a measure failed.

Checks, on CUDA with the `SMALL` shapes below (GPU-bound: a missing wait would show), every
run through the Coordinator as `dflash run` does:
  cuda_paths              two pipeline runs with target and drafter on cuda:0 finish with finite
                          losses and take every CUDA path: streams per stage, CUDA `ready` events,
                          features left on the GPU (one GPU, no cache) and, with a feature cache,
                          D2H into pinned memory and cache hits from pinned memory, flex
                          BlockMasks with the compiled flex_attention, a bf16 target, the
                          training's attention under bf16 autocast (seen by wrappers that only
                          look; the eval's fp32 calls are counted apart), and the end-of-run
                          eval (speculative decoding; τ and lossless reported)
  cpu_reference_losses    the same tiny config (`REF`) on CPU in float32 and on CUDA, the target
                          built on the host for both (same weights): every step's `train_step`
                          loss within REF_TOL = 1e-2 relative (bf16 target and autocast)
  no_unnamed_syncs        runs with `pipeline.sync_debug = true` (torch's CUDA sync debug mode
                          "error" after warm-up, the named syncs exempt) finish, with the mode
                          seen on: serial (nothing overlaps, so no named sync hides another
                          thread's) and pipeline
  pipeline_equals_serial  pipeline runs (features on the GPU; D2H through pinned buffers) against
                          `pipeline.mode = "serial"`, same seed: every step's loss and the final
                          weights bit-identical (else within RACE_TOL = 1e-3 relative, stated)
  families                for `drafter.family` "dflash2" and "dspark" (their convolutions,
                          selector, Markov and confidence heads): the `REF` config's losses on
                          CPU and CUDA within REF_TOL at every step, and a `SMALL` pipeline run
                          (features on the GPU, with its end-of-run eval) against the serial
                          loop, as pipeline_equals_serial judges it; τ and lossless reported
  families_syncs          no_unnamed_syncs for "dflash2" and "dspark"
The families' checks run after the measures, each only if the time budget still holds what it
needs on an H200 (families 170 s, families_syncs 80 s), else SKIP; alone:
`GPU_CHECK_ONLY="families families_syncs"` runs only what it names, in its order (checks and
measures alike, but pipeline_equals_serial and peak_memory, which need the runs before them;
target_forward and pipeline_vs_serial need bench_setup first, drafter_step target_forward too).
Measures, on the bench config (configs/gpu_bench.toml: a Qwen3-8B-shaped random target, a
5-layer drafter), FLOPs counted as 2 per multiply-add of the model's matmuls:
  matmul_peak             bf16 8192³ torch.matmul, CUDA events, best of 3 × 20
  flex_compile            first create_block_mask + first (compiling) flex forward at the bench's
                          attention shapes, against the next ones
  target_forward          8 × 1,024 tokens through the target up to its last captured layer
                          (causal attention counted half): TFLOP/s, share of matmul_peak
                          (target ≥ 50 %)
  drafter_step            forward + backward of one 8 × 1,024-token batch (attention and
                          recomputation not counted): TFLOP/s
  pipeline_vs_serial      steady tokens/s of both modes on one GPU, past warm-up (target:
                          pipeline ≥ serial)
  peak_memory             torch.cuda.max_memory_allocated of each phase
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if os.environ.get("GPU_CHECK_SITE"):  # wheels installed beside an unwritable python: after its own packages
    sys.path.append(os.environ["GPU_CHECK_SITE"])

import torch  # noqa: E402

BENCH = ROOT / "configs" / "gpu_bench.toml"
REF_TOL = 1e-2  # cpu_reference_losses: |Δloss| / |loss_cpu| per step (bf16 has an 8-bit mantissa: ~4e-3 a rounding)
RACE_TOL = 1e-3  # pipeline_equals_serial when not bit-identical: per-step loss and per-tensor ‖Δw‖/‖w‖
TRACE_MAX_EVENTS = 50_000  # per bench trace: bounds its JSON, and so runs.tar.gz

# The shapes of the runs: overrides of configs/gpu_bench.toml. On CUDA the heads are the bench's
# (32 / 8 of 128), so that the compiled flex kernels of one run serve the others where they can.
TINY = {  # the dry run: everything on CPU, quick
    "target.tiny.vocab_size": 512, "target.tiny.hidden_size": 64, "target.tiny.num_layers": 4,
    "target.tiny.num_heads": 4, "target.tiny.num_kv_heads": 2, "target.tiny.head_dim": 16,
    "target.tiny.intermediate_size": 128, "data.num_samples": 64, "data.prompt_len": 32, "data.gen_len": 32,
    "data.max_seq_len": 64, "drafter.max_anchors": 8, "drafter.sliding_window": 32,
}  # fmt: skip
REF = {  # the CPU-vs-CUDA loss check: tiny, with the bench's heads
    **TINY, "target.tiny.num_heads": 32, "target.tiny.num_kv_heads": 8, "target.tiny.head_dim": 128,
}  # fmt: skip
SMALL = {  # the CUDA path checks: more GPU work per step than host work (GPU-bound)
    "target.tiny.vocab_size": 65536, "target.tiny.hidden_size": 2048, "target.tiny.num_layers": 12,
    "target.tiny.num_heads": 32, "target.tiny.num_kv_heads": 8, "target.tiny.head_dim": 128,
    "target.tiny.intermediate_size": 8192, "data.num_samples": 128, "data.prompt_len": 256, "data.gen_len": 256,
    "data.max_seq_len": 512, "drafter.max_anchors": 64, "drafter.sliding_window": 256,
    "drafter.intermediate_size": 2048,  # a drafter of 190 M parameters: quick to build on the host
}  # fmt: skip
COMMON = {
    "eval.at_end": False, "checkpoint.at_end": False, "checkpoint.export_final": False, "profile.interval_s": 1.0,
}  # fmt: skip


class CheckFailed(Exception):
    """A check ran and its verdict is FAIL (the message is the detail)."""


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:400] if not isinstance(err, CheckFailed) else text


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(v)  # strings and lists of strings: valid TOML too


@dataclass
class Context:
    out: Path  # gpu_check.json
    dry: bool
    dev: str  # "cuda:0", or "cpu" in a dry run
    budget_s: float
    work: Path | None = None  # run folders, traces and reports (default: `out`)
    t0: float = field(default_factory=time.perf_counter)
    checks: dict[str, dict[str, str]] = field(default_factory=dict)
    measures: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # what one check hands to a later one

    @property
    def where(self) -> Path:
        """The folder of run folders, traces and reports."""
        return self.work or self.out

    @property
    def cuda(self) -> bool:
        return self.dev.startswith("cuda")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def say(self, *parts: Any, stamp: bool = True) -> None:
        """One line; ends with the seconds since the start (where the budget went)."""
        line = " ".join(" ".join(str(p).split()) for p in parts if str(p))
        print(line + (f" [{self.elapsed():.0f} s]" if stamp else ""), flush=True)

    def config(self, name: str, shapes: dict[str, Any], device: str | None = None, **sets: Any) -> Any:
        """configs/gpu_bench.toml with these shapes, on `device` (default: the check's device)."""
        from dflash import load_config

        device = device or self.dev
        full = {**COMMON, **shapes, "run.name": name, "run.output_dir": str(self.where / "runs"),
                "pipeline.target_devices": [device], "pipeline.drafter_devices": [device], **sets}  # fmt: skip
        if device == "cpu":
            full["target.dtype"] = "float32"
        return load_config(BENCH, [f"{k}={toml_value(v)}" for k, v in full.items()])

    def shapes(self, gpu: dict[str, Any]) -> dict[str, Any]:
        return gpu if self.cuda else TINY

    # -- verdicts -------------------------------------------------------------------------
    def check(self, name: str, fn: Callable[[], str], *, cuda: str = "judge") -> None:
        """Run a check and print its line. `cuda`: "require" (dry run: SKIP, not run),
        "exercise" (dry run: run on CPU, then SKIP: its verdict means something on CUDA only),
        "judge" (judged on any device)."""
        if self.dry and cuda == "require":
            return self._verdict(name, "SKIP", "(no CUDA)")
        try:
            detail = fn()
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            return self._verdict(name, "FAIL", one_line(err))
        finally:
            self.free()
        if self.dry and cuda == "exercise":
            self.checks[name] = {"status": "SKIP", "detail": f"(no CUDA) ran on CPU: {detail}"}
            self.say("SKIP", name, "(no CUDA)")
            return self.save(partial=True)
        self._verdict(name, "PASS", detail)

    def _verdict(self, name: str, status: str, detail: str) -> None:
        self.checks[name] = {"status": status, "detail": " ".join(detail.split())}
        self.say(status, name, detail)
        self.save(partial=True)

    def measure(self, name: str, fn: Callable[[], tuple[dict[str, Any], str]], *, reserve_s: float = 0.0,
                cuda: bool = False) -> None:  # fmt: skip
        """Run a measure: `fn` returns (figures, the printed summary). `reserve_s`: skipped when
        less than this is left of the time budget. `cuda`: CUDA only (dry run: SKIP)."""
        if cuda and not self.cuda:
            self.measures[name] = {"status": "SKIP", "detail": "(no CUDA)"}
            self.say("SKIP", name, "(no CUDA)")
            return
        left = self.budget_s - self.elapsed()
        if left < reserve_s:
            self.measures[name] = {"status": "SKIP", "detail": f"(time budget: {left:.0f} s left)"}
            self.say("SKIP", name, f"(time budget: {left:.0f} s left of {self.budget_s:.0f})")
            return
        try:
            figures, summary = fn()
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            self.measures[name] = {"status": "FAIL", "detail": one_line(err)}
            self.say("FAIL", name, one_line(err))
        else:
            self.measures[name] = {"status": "OK", **figures}
            self.say("MEASURE", name, summary)
        self.free()
        self.save(partial=True)

    def free(self) -> None:
        """The GPU memory of finished runs back (a run and its Coordinator refer to each other)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def result(self, partial: bool) -> dict[str, Any]:
        failed = [n for n, c in self.checks.items() if c["status"] == "FAIL"]
        failed += [n for n, m in self.measures.items() if m.get("status") == "FAIL"]
        return {
            "bench": "gpu_check", "dry_run": self.dry, "partial": partial, **self.info,
            "elapsed_s": round(self.elapsed(), 1), "ok": not failed, "failed": failed,
            "checks": self.checks, "measures": self.measures, "targets": self.targets, "out": str(self.out),
        }  # fmt: skip

    def save(self, partial: bool) -> dict[str, Any]:
        res = self.result(partial)
        with contextlib.suppress(OSError):
            (self.out / "gpu_check.json").write_text(json.dumps(res) + "\n")
        return res


# -- running dflash ----------------------------------------------------------------------------
@dataclass
class Run:
    records: list[dict[str, Any]]
    stamps: list[tuple[float, dict[str, Any]]]  # (arrival time, train_step record)
    coord: Any

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [r for _, r in self.stamps]

    @property
    def losses(self) -> list[float | None]:
        return [r["loss"] for r in self.steps]

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.coord.replicas[0].model.state_dict().items()}


def run_dflash(cfg: Any, training: Any = None, observe: Callable[[dict[str, Any]], None] | None = None,
               timeout_s: float | None = None) -> Run:  # fmt: skip
    """One run through the Coordinator (as `dflash run` does: uvloop when installed)."""
    from dflash.pipeline.coordinator import Coordinator

    coord = Coordinator(cfg, log=False, training=training)
    run = Run([], [], coord)

    def subscriber(rec: dict[str, Any]) -> None:
        run.records.append(rec)
        if rec["event"] == "train_step":
            run.stamps.append((time.perf_counter(), rec))
        if observe is not None:
            observe(rec)

    coord.subscribe(subscriber)
    factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(coord.run(), timeout_s))
    return run


@contextlib.contextmanager
def patched(obj: Any, name: str, make: Callable[[Any], Any], missing: list[str]) -> Iterator[None]:
    """obj.name replaced by make(original) for the block; noted in `missing` if absent."""
    orig = getattr(obj, name, None)
    if orig is None:
        missing.append(f"{getattr(obj, '__name__', obj)}.{name}")
        yield
        return
    setattr(obj, name, make(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


class Probe:
    """Watches which CUDA paths a run takes. Its wrappers only look: same calls, same results."""

    def __init__(self) -> None:
        self.streams: set[tuple[str, str]] = set()  # (device name, stage)
        self.events: dict[str, int] = {}  # type of each `ready` a CUDA Device.run returned
        self.held: dict[str, int] = {}  # per stage: tensors held for a consuming stream (record_stream)
        self.d2h: list[tuple[bool, str]] = []  # per D2H copy from a GPU: (into pinned memory, dtype)
        self.cache_hits: list[bool] = []  # per feature-cache hit: pinned
        self.masks: dict[str, int] = {}  # type of each mask flex_block_mask built
        # The drafter's attention calls made by its training compute: (q, k, v dtypes, autocast on)
        self.attention: set[tuple[str, str, str, bool]] = set()
        self.other_attention = 0  # calls outside training compute (the end-of-run eval: fp32, no autocast)
        self.missing: list[str] = []  # what could not be watched (renamed in dflash?)
        self._training = threading.local()  # .on: inside MicroStep.compute, in this thread

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        import dflash.features.cache as feature_cache
        import dflash.model.drafter as drafter
        import dflash.model.masks as masks
        import dflash.runtime.devices as devices
        import dflash.stages.transfer as transfer
        import dflash.train.step as train_step

        def count(d: dict[str, int], key: str, n: int = 1) -> None:
            d[key] = d.get(key, 0) + n

        def stream(orig: Any) -> Any:
            def wrapper(dev: Any, stage: str, *args: Any, **kwargs: Any) -> Any:
                self.streams.add((dev.name, stage))
                return orig(dev, stage, *args, **kwargs)

            return wrapper

        def hold(orig: Any) -> Any:
            def wrapper(dev: Any, stage: str | None, uses: Any, stream: Any) -> Any:
                uses = list(uses)
                if stream is not None and uses:
                    count(self.held, stage or "untimed", len(uses))
                return orig(dev, stage, uses, stream)

            return wrapper

        def run(orig: Any) -> Any:
            async def wrapper(dev: Any, *args: Any, **kwargs: Any) -> Any:
                out = await orig(dev, *args, **kwargs)
                ready = out[1] if isinstance(out, tuple) and len(out) == 2 else None
                if getattr(dev, "is_cuda", False) and ready is not None:
                    count(self.events, type(ready).__name__)
                return out

            return wrapper

        def to_host(orig: Any) -> Any:
            def wrapper(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                out = orig(hidden, *args, **kwargs)
                t = out if isinstance(out, torch.Tensor) else out[0]  # (host tensor, release) or the tensor
                if hidden.is_cuda:
                    self.d2h.append((t.device.type == "cpu" and t.is_pinned(), str(t.dtype)))
                return out

            return wrapper

        def cache_get(orig: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                out = orig(*args, **kwargs)
                if out is not None:
                    self.cache_hits.append(torch.cuda.is_available() and out[0].is_pinned())
                return out

            return wrapper

        def block_mask(orig: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                m = orig(*args, **kwargs)
                count(self.masks, type(m).__name__)
                return m

            return wrapper

        # Only the training's attention must run under autocast: the end-of-run eval decodes
        # with the fp32 master weights and no autocast, on purpose. A call is the training's
        # when it is made inside MicroStep.compute (forward + loss + backward of one batch, the
        # hook every training loop goes through), in the same thread: a flag set around that
        # call says so exactly. Grad mode would be a weaker sign (a no-grad recomputation in
        # training would be missed, any future grad-enabled eval counted), and stopping the
        # recording before the eval would depend on when the Coordinator starts it.
        def training_compute(orig: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                outer = getattr(self._training, "on", False)
                self._training.on = True
                try:
                    return orig(*args, **kwargs)
                finally:
                    self._training.on = outer

            return wrapper

        def attend(orig: Any) -> Any:
            def wrapper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Any:
                self.note_attention(q, k, v)
                return orig(q, k, v, mask)

            return wrapper

        with contextlib.ExitStack() as stack:
            for obj, name, make in [
                (devices.Device, "stream", stream), (devices.Device, "hold", hold), (devices.Device, "run", run),
                (transfer, "to_host", to_host), (feature_cache.FeatureCache, "get", cache_get),
                (masks, "flex_block_mask", block_mask), (drafter, "attend", attend),
                (train_step.MicroStep, "compute", training_compute),
            ]:  # fmt: skip
                stack.enter_context(patched(obj, name, make, self.missing))
            yield

    def note_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """One call of the drafter's `attend`: kept with its dtypes and autocast state when
        made by the training compute, else only counted."""
        if not getattr(self._training, "on", False):
            self.other_attention += 1
            return
        try:
            on = torch.is_autocast_enabled(q.device.type)
        except TypeError:  # an older torch: no device argument
            on = torch.is_autocast_enabled()
        self.attention.add((str(q.dtype), str(k.dtype), str(v.dtype), on))

    def autocast_problem(self) -> str | None:
        """What is wrong with the training's attention on CUDA (None: every call under autocast)."""
        if not self.attention:
            return f"no attention call in training compute ({self.other_attention} outside it)"
        if not all(on for *_, on in self.attention):
            return f"training attention not under autocast: {sorted(self.attention)}"
        return None

    def verdict(self, run: Run, steps: int, d2h: bool, evaluated: bool) -> tuple[list[str], str]:
        """(what is wrong on CUDA, what was seen). `d2h`: the run must copy features to the
        host (a feature cache) and read cache hits from pinned memory. `evaluated`: it ends
        with an eval (speculative decoding against the target's greedy output)."""
        import dflash.model.drafter as drafter
        from dflash.runtime.profiler import Stage

        bad = []
        losses = run.losses
        if len(losses) != steps or any(x is None or not math.isfinite(x) for x in losses):
            bad.append(f"expected {steps} steps with finite losses, got {losses}")
        by_dev: dict[str, list[str]] = {}
        for dev, stage in sorted(self.streams):
            by_dev.setdefault(dev, []).append(stage)
        tgt = {s for d, s in self.streams if d.startswith("target")}
        if not {Stage.TARGET_FORWARD, Stage.TARGET_PACK} <= tgt:
            bad.append(f"target stages not on streams of their own ({sorted(tgt)})")
        drf = {s for d, s in self.streams if d.startswith("drafter")}
        if not {Stage.DRAFTER_PREPARE, Stage.DRAFTER_FORWARD} <= drf:
            bad.append(f"drafter prepare and forward/backward not on streams of their own ({sorted(drf)})")
        n_events = self.events.get("Event", 0)
        if not n_events or set(self.events) - {"Event"}:
            bad.append(f"ready events: {self.events}")
        if d2h and (not self.d2h or not all(p for p, _ in self.d2h)):
            bad.append(f"D2H: {sum(p for p, _ in self.d2h)} of {len(self.d2h)} copies into pinned memory")
        hits = run.records[-1].get("feature_cache") or {} if run.records else {}
        if d2h and (not self.cache_hits or not all(self.cache_hits)):
            bad.append(f"feature-cache hits: {sum(self.cache_hits)} of {len(self.cache_hits)} pinned ({hits})")
        if not self.masks.get("BlockMask"):
            bad.append(f"no flex BlockMask (masks built: {self.masks or 'none'})")
        compiled = getattr(drafter, "_compiled_flex", None) is not None
        if not compiled:
            bad.append("flex_attention was not compiled")
        dtype = str(run.coord.targets[0].embed_weight.dtype).removeprefix("torch.") if run.coord.targets else "?"
        if dtype != "bfloat16":
            bad.append(f"target in {dtype}")
        autocast_bad = self.autocast_problem()
        if autocast_bad:
            bad.append(autocast_bad)
        evals = [r for r in run.records if r["event"] == "eval"]
        if evaluated and not evals:
            warned = [r["message"] for r in run.records if r["event"] == "warning"]
            bad.append(f"no end-of-run eval ({warned[-1] if warned else 'no record'})")
        if self.missing:
            bad.append(f"could not watch {self.missing}")
        qkv = ", ".join(sorted({f"{q}/{k}/{v}".replace("torch.", "") for q, k, v, _ in self.attention}))
        seen = [
            f"{len(losses)} steps",
            "streams " + (" ".join(f"{d}[{','.join(s)}]" for d, s in by_dev.items()) or "none"),
            f"{n_events} CUDA ready events",
            "record_stream " + (", ".join(f"{k}×{n}" for k, n in sorted(self.held.items())) or "none"),
            (f"D2H ×{len(self.d2h)} ({sum(p for p, _ in self.d2h)} into pinned memory, {self.d2h[0][1]})"
             if self.d2h else "no D2H from a GPU"),
            f"feature-cache hits ×{len(self.cache_hits)} ({sum(self.cache_hits)} pinned)" if d2h else "",
            f"flex BlockMask ×{self.masks.get('BlockMask', 0)}, {'compiled' if compiled else 'eager'} flex_attention",
            f"target {dtype}, training attention q/k/v {qkv}" + ("" if autocast_bad else " under autocast")
            + (f" (+{self.other_attention} calls outside training)" if self.other_attention else ""),
            (f"eval τ {evals[-1]['tau']}, lossless {evals[-1]['lossless']}"
             + ("" if evals[-1]["lossless"] else " (bf16: greedy decoding and verify may part on a near-tie)"))
            if evals else "",
        ]  # fmt: skip
        return bad, "; ".join(x for x in seen if x)


@contextlib.contextmanager
def tiny_target_built_on_host() -> Iterator[None]:
    """`build_tiny` builds a CUDA target on the device with the CUDA generator, so a CUDA run
    and a CPU run of the same config would start from different weights. Here it builds on the
    host (CPU generator, the CPU run's weights); `load_target` then moves it to the device."""
    import dflash.model.target as target

    missing: list[str] = []
    with patched(target, "build_tiny", lambda orig: lambda cfg, device=None: orig(cfg, None), missing):
        if missing:
            msg = f"cannot build the tiny target on the host: {missing} not found"
            raise CheckFailed(msg)
        yield


# -- checks ------------------------------------------------------------------------------------
# The pipeline runs of the checks: (overrides, steps on CUDA, steps in a dry run). On one GPU the
# features stay on it (no D2H); with a feature cache they go to the host through pinned buffers
# (PinnedPool), and in a second epoch come back from the cache's pinned copies. The serial loop
# is compared with runs whose every batch takes the same path in both modes: with cache hits
# (filled asynchronously in the pipeline) a batch may hit in one mode and miss in the other.
RUNS = {
    "device_features": ({}, 8, 6),
    "d2h_and_cache": ({"data.feature_cache_mb": 1024, "data.num_samples": 48, "train.epochs": 2}, 10, 6),
    "d2h": ({"data.feature_cache_mb": 1024, "data.num_samples": 48}, 6, 4),
}


def path_config(ctx: Context, kind: str, mode: str, name: str = "", **extra: Any) -> Any:
    sets, steps, dry_steps = RUNS[kind]
    if not ctx.cuda:  # TINY shapes: fewer samples
        sets = {**sets, "data.num_samples": 32} if "data.num_samples" in sets else sets
    full = {**sets, "train.max_steps": steps if ctx.cuda else dry_steps, "train.log_every": 2, "pipeline.mode": mode}
    if kind == "device_features" and mode == "pipeline":  # the eval's CUDA path too: speculative decoding
        full.update({"eval.at_end": True, "eval.num_prompts": 2, "eval.max_new_tokens": 32})
    return ctx.config(name or f"{kind}_{mode}", ctx.shapes(SMALL), **{**full, **extra})


def watched_run(ctx: Context, kind: str, mode: str = "pipeline") -> tuple[list[str], str]:
    """A run under a Probe; its losses and final weights kept for pipeline_equals_serial."""
    cfg = path_config(ctx, kind, mode)
    probe = Probe()
    with probe.watching():
        run = run_dflash(cfg, timeout_s=150)
    ctx.state[kind] = (run.losses, run.weights(), len(probe.streams))
    bad, seen = probe.verdict(run, cfg.train.max_steps, d2h=kind != "device_features", evaluated=cfg.eval.at_end)
    return [f"{kind}: {x}" for x in bad], f"{kind}: {seen}"


def check_cuda_paths(ctx: Context) -> str:
    bad, seen = [], []
    for kind in ("device_features", "d2h_and_cache"):  # both, whatever the first gives
        try:
            b, s = watched_run(ctx, kind)
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            b, s = [f"{kind}: {one_line(err)}"], f"{kind}: failed"
        bad, seen = bad + b, [*seen, s]
    ctx.state.pop("d2h_and_cache", None)
    # What the Probe could not watch (dflash renamed it) fails on CPU too: a dry run says so
    # before a GPU is spent on a check that cannot judge.
    blind = [b for b in bad if "could not watch" in b]
    if (ctx.cuda and bad) or blind:
        raise CheckFailed("; ".join(bad if ctx.cuda else blind) + " — seen: " + " | ".join(seen))
    return " | ".join(seen)


def reference_losses(ctx: Context, **extra: Any) -> tuple[float, str]:
    """The same tiny config on CPU in float32 and on the check's device (`extra`: more
    overrides, a family): the worst relative loss difference and the detail; CheckFailed
    beyond REF_TOL."""
    steps = 6
    prefix = f"{extra['drafter.family']}_" if "drafter.family" in extra else ""
    sets = {"train.max_steps": steps, "train.log_every": 1, **extra}
    shapes = REF if ctx.cuda else TINY
    cpu = run_dflash(ctx.config(f"{prefix}ref_cpu", shapes, "cpu", **sets), timeout_s=120)
    with tiny_target_built_on_host():
        dev = run_dflash(ctx.config(f"{prefix}ref_device", shapes, **sets), timeout_s=120)
    a, b = cpu.losses, dev.losses
    if len(a) != steps or len(b) != steps or None in a or None in b:
        raise CheckFailed(f"expected {steps} finite losses on each side; cpu {a}, {ctx.dev} {b}")
    rel = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True)]
    worst = max(rel)
    detail = (
        f"{steps} steps, max |Δloss|/loss {worst:.1e} at step {rel.index(worst) + 1} (tolerance {REF_TOL:g}); "
        f"cpu float32 {a[0]:.5f}..{a[-1]:.5f}, {ctx.dev} {b[0]:.5f}..{b[-1]:.5f}"
    )
    if worst > REF_TOL:
        raise CheckFailed(detail)
    return worst, detail


def check_reference_losses(ctx: Context) -> str:
    return reference_losses(ctx)[1]


def sync_debug_run(ctx: Context, kind: str, mode: str, **extra: Any) -> str:
    """One run with `pipeline.sync_debug = true`: it must finish, with the mode seen on."""
    prefix = f"{extra['drafter.family']}_" if "drafter.family" in extra else ""
    sets = {"pipeline.sync_debug": True, "eval.at_end": False, **extra}
    cfg = path_config(ctx, kind, mode, f"{prefix}sync_debug_{mode}", **sets)
    modes: set[int] = set()

    def observe(rec: dict[str, Any]) -> None:
        modes.add(torch.cuda.get_sync_debug_mode())  # process-wide; read on the loop thread

    try:
        run = run_dflash(cfg, observe=observe, timeout_s=150)
    finally:
        torch.cuda.set_sync_debug_mode(0)  # whatever the run left: later measures read values back
    steps = cfg.train.max_steps
    if len(run.steps) != steps:
        raise CheckFailed(f"{len(run.steps)} of {steps} steps")
    if 2 not in modes:
        raise CheckFailed(f"the run finished, but the sync debug mode was never 'error' (seen {sorted(modes)})")
    return f"{steps} steps"


def check_sync_debug(ctx: Context, **extra: Any) -> str:
    """The mode is process-wide and off while any named sync runs (dflash.runtime.devices): in the
    pipeline, a long named wait in one thread (the D2H wait, the grad-norm sync) leaves the
    others unchecked meanwhile. The serial loop overlaps nothing, so there every stage
    function is checked all the time (D2H, feature-cache hits included); the pipeline run
    (features on the GPU: the fewest named syncs) checks what only the pipeline runs."""
    from dflash import ConfigError

    out, bad = [], []
    for kind, mode in (("d2h_and_cache", "serial"), ("device_features", "pipeline")):
        try:
            out.append(f"{mode} ({kind}): {sync_debug_run(ctx, kind, mode, **extra)}")
        except ConfigError as err:
            msg = f"the config does not accept pipeline.sync_debug ({one_line(err)})"
            raise CheckFailed(msg) from None
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            bad.append(f"{mode} ({kind}): {one_line(err)}")
    if bad:
        raise CheckFailed("; ".join(bad + out))
    return "; ".join(out) + ", torch.cuda sync debug mode 'error' after warm-up: no unnamed host sync"


def compare(la: list[Any], wa: dict[str, torch.Tensor], lb: list[Any], wb: dict[str, torch.Tensor]) -> str | None:
    """None when bit-identical; else the differences, failing beyond RACE_TOL."""
    if len(la) != len(lb) or wa.keys() != wb.keys() or None in la or None in lb:
        raise CheckFailed(f"{len(la)} against {len(lb)} steps, same tensors: {wa.keys() == wb.keys()}")
    if la == lb and all(torch.equal(wa[k], wb[k]) for k in wa):
        return None
    loss_rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(la, lb, strict=True))
    w_rel = max(float((wa[k].float() - wb[k].float()).norm() / wa[k].float().norm().clamp(min=1e-12)) for k in wa)
    text = f"not bit-identical: max |Δloss|/loss {loss_rel:.1e}, max ‖Δw‖/‖w‖ {w_rel:.1e} (tolerance {RACE_TOL:g})"
    if loss_rel > RACE_TOL or w_rel > RACE_TOL:
        raise CheckFailed(text)
    return text


def check_pipeline_equals_serial(ctx: Context) -> str:
    out = []
    for kind in ("device_features", "d2h"):
        if kind == "d2h":
            watched_run(ctx, kind)
        if kind not in ctx.state:
            raise CheckFailed(f"no {kind} pipeline run to compare with (cuda_paths failed)")
        la, wa, n_streams = ctx.state.pop(kind)
        serial = run_dflash(path_config(ctx, kind, "serial"), timeout_s=150)
        try:
            diff = compare(la, wa, serial.losses, serial.weights())
        except CheckFailed as err:
            raise CheckFailed(f"{kind}: {err}") from None
        where = f"{n_streams} streams" if ctx.cuda else "CPU"
        out.append(f"{kind} ({len(la)} steps, {where}): " + (diff or "losses and final weights bit-identical"))
    return "; ".join(out)


FAMILIES = ("dflash2", "dspark")


def check_families(ctx: Context) -> str:
    """Each successor family through the CUDA paths: losses against CPU float32, and pipeline
    against serial with its own end-of-run eval (its own proposal: the selector's walk, the
    Markov-biased tokens)."""
    out, bad = [], []
    for fam in FAMILIES:
        try:
            fam_set = {"drafter.family": fam}
            worst, _ = reference_losses(ctx, **fam_set)
            pipe = run_dflash(path_config(ctx, "device_features", "pipeline", f"{fam}_pipeline", **fam_set),
                              timeout_s=150)  # fmt: skip
            serial = run_dflash(path_config(ctx, "device_features", "serial", f"{fam}_serial", **fam_set),
                                timeout_s=150)  # fmt: skip
            diff = compare(pipe.losses, pipe.weights(), serial.losses, serial.weights())
            evals = [r for r in pipe.records if r["event"] == "eval"]
            if not evals:
                raise CheckFailed("no end-of-run eval")
            out.append(
                f"{fam}: losses against CPU max {worst:.1e}; pipeline ({len(pipe.losses)} steps) against serial: "
                f"{diff or 'bit-identical'}; eval τ {evals[-1]['tau']}, lossless {evals[-1]['lossless']}"
            )
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            bad.append(f"{fam}: {one_line(err)}")
    if bad:
        raise CheckFailed("; ".join(bad + out))
    return "; ".join(out)


def check_families_syncs(ctx: Context) -> str:
    """no_unnamed_syncs for each successor family (its selector walk, Markov and confidence
    losses run in the drafter's step)."""
    return "; ".join(f"{fam}: {check_sync_debug(ctx, **{'drafter.family': fam})}" for fam in FAMILIES)


# -- measures ----------------------------------------------------------------------------------
def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def timed(dev: str, fn: Callable[[], Any], n: int) -> list[float]:
    """Seconds per call, n calls (CUDA events on the current stream; else the wall clock)."""
    out = []
    for _ in range(n):
        if dev.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def first_call(dev: str, fn: Callable[[], Any]) -> tuple[Any, float]:
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t


def measure_matmul_peak(ctx: Context) -> tuple[dict[str, Any], str]:
    n, dtype, reps = (8192, torch.bfloat16, 20) if ctx.cuda else (256, torch.float32, 5)
    a = torch.randn(n, n, device=ctx.dev, dtype=dtype)
    b = torch.randn(n, n, device=ctx.dev, dtype=dtype)
    c = torch.empty(n, n, device=ctx.dev, dtype=dtype)

    def loop() -> None:
        for _ in range(reps):
            torch.matmul(a, b, out=c)

    timed(ctx.dev, loop, 1)  # warm-up
    best = min(timed(ctx.dev, loop, 3))
    tflops = 2 * n**3 * reps / best / 1e12
    ctx.state["peak"] = tflops
    name = str(dtype).removeprefix("torch.")
    return ({"tflops": round(tflops, 3), "n": n, "dtype": name},
            f"{tflops:.3g} TFLOP/s ({name} {n}³ torch.matmul, best of 3 × {reps})")  # fmt: skip


def bench_shapes(ctx: Context) -> dict[str, Any]:
    """The bench config's overrides: as configs/gpu_bench.toml on CUDA, tiny in a dry run."""
    return {} if ctx.cuda else {**TINY, "data.num_samples": 64}


def measure_flex_compile(ctx: Context) -> tuple[dict[str, Any], str]:
    """The first BlockMask and the first (compiling) flex forward at the bench's attention
    shapes: R rows, T context, N blocks of B, the target's heads; bf16 on CUDA."""
    from dflash.model.drafter import attend
    from dflash.model.masks import BlockLayout, layer_masks

    cfg = ctx.config("flex", bench_shapes(ctx))
    tiny, d = cfg.target.tiny, cfg.drafter
    R, T = cfg.data.batch_size, (1024 if ctx.cuda else cfg.data.max_seq_len)
    B, N = d.block_size, min(d.max_anchors, T // 2 - d.block_size)
    g = torch.Generator().manual_seed(0)
    anchors = torch.stack([(T // 2 + torch.randperm(T // 2 - B, generator=g)[:N]).sort().values for _ in range(R)])
    layout = BlockLayout(anchors.to(ctx.dev), torch.ones(R, N, dtype=torch.bool, device=ctx.dev),
                         torch.zeros(R, T, dtype=torch.long, device=ctx.dev), B)  # fmt: skip
    spec = SimpleNamespace(layer_types=d.resolved_layer_types, sliding_window=d.sliding_window,
                           sliding_causal_block=d.sliding_causal_block)  # fmt: skip
    masks, first_mask = first_call(ctx.dev, lambda: layer_masks(layout, spec, True))
    mask_s = min(timed(ctx.dev, lambda: layer_masks(layout, spec, True), 3))
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    q = torch.randn(R, tiny.num_heads, N * B, tiny.head_dim, device=ctx.dev, dtype=dtype)
    k = torch.randn(R, tiny.num_kv_heads, T + N * B, tiny.head_dim, device=ctx.dev, dtype=dtype)
    v = torch.randn_like(k)
    mask = next(iter(masks.values()))
    _, first_fwd = first_call(ctx.dev, lambda: attend(q, k, v, mask))
    fwd_s = min(timed(ctx.dev, lambda: attend(q, k, v, mask), 3))
    compile_s = first_mask + first_fwd - mask_s - fwd_s
    figures = {
        "compile_s": round(compile_s, 2), "first_mask_s": round(first_mask, 3), "first_forward_s": round(first_fwd, 3),
        "mask_ms": round(mask_s * 1e3, 3), "forward_ms": round(fwd_s * 1e3, 3),
        "shape": {"rows": R, "context": T, "blocks": N, "block_size": B, "heads": tiny.num_heads,
                  "kv_heads": tiny.num_kv_heads, "head_dim": tiny.head_dim},
    }  # fmt: skip
    summary = (
        f"{compile_s:.1f} s (first create_block_mask {first_mask:.2f} s + first flex forward {first_fwd:.2f} s; "
        f"then {mask_s * 1e3:.1f} ms + {fwd_s * 1e3:.1f} ms) at {R} × ({T} + {N}·{B})"
    )
    return figures, summary


def peak_gb(ctx: Context) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if ctx.cuda else None


def reset_peak(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()


def bench_config(ctx: Context, mode: str, steps: int) -> Any:
    sets = {"train.max_steps": steps, "train.log_every": 2, "pipeline.mode": mode,
            "profile.trace": str(ctx.where / f"bench_{mode}.trace.json"),
            "profile.trace_max_events": TRACE_MAX_EVENTS}  # fmt: skip
    return ctx.config(f"bench_{mode}", bench_shapes(ctx), **sets)


def measure_bench_setup(ctx: Context) -> tuple[dict[str, Any], str]:
    from dflash.train.build import build_training

    steps = int(os.environ.get("GPU_CHECK_BENCH_STEPS", "12" if ctx.cuda else "6"))
    cfg = bench_config(ctx, "pipeline", steps)
    reset_peak(ctx)
    t, secs = first_call(ctx.dev, lambda: build_training(cfg))
    ctx.state["bench"] = (t, steps)
    tgt, rep = t.targets[0], t.replicas[0]
    params = sum(p.numel() for p in rep.params)
    return ({"setup_s": round(secs, 1), "target_layers": tgt.num_layers, "captured": tgt.layer_ids,
             "drafter_params": params, "memory_gb": peak_gb(ctx)},
            f"bench set-up {secs:.1f} s: target {tgt.num_layers} layers (captures {tgt.layer_ids}), "
            f"drafter {rep.model.spec.num_layers} layers, {params / 1e6:.1f} M parameters")  # fmt: skip


def bench_batch(ctx: Context, t: Any, rows: int, length: int) -> Any:
    """One collated batch of `rows` documents of `length` random tokens, the second half
    supervised (no mask token), through the prefetch stage's own function (pinned on CUDA)."""
    from dflash.data.samples import Sample
    from dflash.stages.prefetch import next_batch

    g = torch.Generator().manual_seed(1)
    mask_id, vocab = t.spec.mask_token_id, t.targets[0].vocab_size
    docs = []
    for i in range(rows):
        ids = torch.randint(0, vocab - 1, (length,), generator=g)
        ids[ids >= mask_id] += 1  # never the mask token
        docs.append([Sample(10**6 + i, ids, torch.arange(length) >= length // 2)])
    return next_batch(iter([(0, 0, docs)]), ctx.cuda)


def measure_target_forward(ctx: Context) -> tuple[dict[str, Any], str]:
    from dflash.stages.pack import pack
    from dflash.stages.target_forward import forward

    if "bench" not in ctx.state:
        raise CheckFailed("no bench set-up (bench_setup failed)")
    t, _ = ctx.state["bench"]
    tgt = t.targets[0]
    rows, length = 8, (1024 if ctx.cuda else TINY["data.max_seq_len"])
    batch = bench_batch(ctx, t, rows, length)
    reset_peak(ctx)
    timed(ctx.dev, lambda: forward(tgt, batch), 2)  # warm-up
    secs = min(timed(ctx.dev, lambda: forward(tgt, batch), 5))
    # model FLOPs, 2 per MAC: projections and MLP of every layer up to the last captured one,
    # plus causal attention (QKᵀ and PV, half of the square)
    H, nh, nkv, hd, inter = tgt.hidden_size, tgt.num_heads, tgt.num_kv_heads, tgt.head_dim, tgt.intermediate_size
    layers = max(tgt.layer_ids) + 1
    tokens = rows * length
    linear = 2 * tokens * (2 * H * nh * hd + 2 * H * nkv * hd + 3 * H * inter)
    attn = 2 * 2 * rows * nh * length * length * hd * 0.5
    flops = layers * (linear + attn)
    tflops = flops / secs / 1e12
    peak = ctx.state.get("peak")
    share = tflops / peak if peak else None
    ctx.state["features"] = (batch, pack(forward(tgt, batch)[0]))  # on the GPU, as a one-GPU pipeline keeps them
    sync(ctx.dev)
    met = (share is not None and share >= 0.5) if ctx.cuda else None  # on CPU a 256³ peak says nothing
    share_r = round(share, 3) if share else None
    ctx.targets["target_forward_share_of_peak"] = {"value": share_r, "target": 0.5, "met": met}
    figures = {
        "ms": round(secs * 1e3, 2), "tflops": round(tflops, 2), "share_of_peak": share_r, "rows": rows,
        "tokens_per_row": length, "layers_run": layers, "flops": flops, "memory_gb": peak_gb(ctx),
    }  # fmt: skip
    share_s = f"{share:.0%} of matmul peak" if share else "no matmul peak"
    verdict = "n/a on CPU" if met is None else "met" if met else "missed"
    return figures, (f"{tflops:.1f} TFLOP/s = {share_s} ({secs * 1e3:.1f} ms for {rows} × {length} tokens, "
                     f"{layers} layers; target ≥ 50 %: {verdict})")  # fmt: skip


def measure_drafter_step(ctx: Context) -> tuple[dict[str, Any], str]:
    from dflash.runtime.devices import Device
    from dflash.runtime.messages import HostFeatures

    if "features" not in ctx.state:
        raise CheckFailed("no target features (target_forward failed)")
    t, _ = ctx.state["bench"]
    batch, hidden = ctx.state.pop("features")
    rep = t.replicas[0]
    device = Device(str(rep.device), "gpu_check")
    try:
        feats = HostFeatures(batch, hidden, 0)
        reset_peak(ctx)
        prep_s = min(timed(ctx.dev, lambda: t.micro.prepare(rep, device, feats, 0), 2))
        p = t.micro.prepare(rep, device, feats, 0)

        def step() -> None:
            t.micro.compute(rep, device, p)
            rep.optimizer.zero_grad(set_to_none=True)

        _, first_s = first_call(ctx.dev, step)  # compiles the flex backward at these shapes
        secs = min(timed(ctx.dev, step, 3))
    finally:
        device.close()
    spec = rep.model.spec
    R, Q = p.block_ids.shape
    T = p.context.shape[1]
    M = int(p.targets.sel.numel())
    H, nh, nkv, hd, inter = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    k, L, V = len(spec.target_layer_ids), spec.num_layers, spec.vocab_size
    # model FLOPs, 2 per MAC: trainable layers forward + backward (3×), fc forward + weight
    # grad (2×: its input needs none), the frozen LM head forward + input grad (2×) over the
    # supervised slots; attention and the LM head's recomputation are not counted
    fc = R * T * k * H * H
    layer = R * Q * 2 * H * nh * hd + 2 * R * (T + Q) * H * nkv * hd + 3 * R * Q * H * inter
    flops = 2 * (2 * fc + 3 * L * layer + 2 * M * H * V)
    tflops = flops / secs / 1e12
    figures = {"ms": round(secs * 1e3, 2), "tflops": round(tflops, 2), "first_ms": round(first_s * 1e3, 1),
               "prepare_ms": round(prep_s * 1e3, 2), "rows": R, "context": T, "query_tokens": R * Q,
               "supervised_slots": M, "flops": flops, "memory_gb": peak_gb(ctx)}  # fmt: skip
    return figures, (f"{tflops:.1f} TFLOP/s forward + backward ({secs * 1e3:.1f} ms; {R} × {T} context, "
                     f"{R * Q} block tokens, {M} supervised; prepare {prep_s * 1e3:.1f} ms; first call "
                     f"{first_s:.1f} s)")  # fmt: skip


def steady_tok_s(run: Run, warm_steps: int) -> tuple[float, int]:
    """Tokens/s between the first record at or past `warm_steps` and the last one."""
    stamps = run.stamps
    start = next((i for i, (_, r) in enumerate(stamps) if r["step"] >= warm_steps), None)
    if start is None or start == len(stamps) - 1:
        raise CheckFailed(f"too few steps for a steady state ({len(stamps)} train_step records)")
    t0, t1 = stamps[start][0], stamps[-1][0]
    later = [r for _, r in stamps[start + 1 :] if r["step"] > stamps[start][1]["step"]]
    return sum(r["tokens"] for r in later) / max(t1 - t0, 1e-9), len(later)


def measure_pipeline_vs_serial(ctx: Context) -> tuple[dict[str, Any], str]:
    from dflash.report import analyze, format_report

    if "bench" not in ctx.state:
        raise CheckFailed("no bench set-up (bench_setup failed)")
    t, steps = ctx.state["bench"]
    figures: dict[str, Any] = {"steps": steps}
    for mode in ("pipeline", "serial"):
        reset_peak(ctx)
        run = run_dflash(bench_config(ctx, mode, steps), training=t, timeout_s=180)
        tok_s, n = steady_tok_s(run, warm_steps=4 if ctx.cuda else 2)
        end = run.records[-1]
        figures[mode] = {"tok_s": round(tok_s, 1), "steady_steps": n, "run_tok_s": end.get("tokens_per_s"),
                         "final_loss": end.get("final_loss"), "memory_gb": peak_gb(ctx)}  # fmt: skip
        try:
            (ctx.where / f"bench_{mode}.report.txt").write_text(format_report(analyze(run.records)) + "\n")
        except Exception as err:  # a report is a convenience: the figures stand without it
            (ctx.where / f"bench_{mode}.report.txt").write_text(f"no report: {one_line(err)}\n")
    ratio = figures["pipeline"]["tok_s"] / max(figures["serial"]["tok_s"], 1e-9)
    figures["ratio"] = round(ratio, 3)
    ctx.targets["pipeline_over_serial"] = {"value": round(ratio, 3), "target": 1.0, "met": ratio >= 1.0}
    p, s = figures["pipeline"], figures["serial"]
    return figures, (f"pipeline {p['tok_s']:.0f} tok/s, serial {s['tok_s']:.0f} tok/s = {ratio:.2f}× "
                     f"(steady, {p['steady_steps']} steps each after warm-up; target pipeline ≥ serial: "
                     f"{'met' if ratio >= 1.0 else 'missed'})")  # fmt: skip


def measure_peak_memory(ctx: Context) -> tuple[dict[str, Any], str]:
    phases = {
        "target_forward": ctx.measures.get("target_forward", {}).get("memory_gb"),
        "drafter_step": ctx.measures.get("drafter_step", {}).get("memory_gb"),
        "pipeline": ctx.measures.get("pipeline_vs_serial", {}).get("pipeline", {}).get("memory_gb"),
        "serial": ctx.measures.get("pipeline_vs_serial", {}).get("serial", {}).get("memory_gb"),
    }
    total = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    seen = {k: v for k, v in phases.items() if v is not None}
    if not seen:
        raise CheckFailed("no phase measured")
    text = ", ".join(f"{k} {v:.1f}" for k, v in seen.items())
    return {"gb": phases, "max_gb": max(seen.values()), "total_gb": total}, (
        f"max allocated {max(seen.values()):.1f} GiB of {total} GiB ({text} GiB)"
    )


@dataclass(frozen=True)
class Step:
    """One check or measure of the run. A check: `cuda` its rule (Context.check); `need_s`:
    on a GPU, SKIP unless that much of the budget is left. A measure: `reserve_s` (starts
    only with that much left), `cuda_only`. `alone`: GPU_CHECK_ONLY may name it (not those
    that need the steps before them)."""

    name: str
    fn: Callable[[Context], Any]
    measure: bool = False
    cuda: str = "judge"
    need_s: float = 0.0
    reserve_s: float = 0.0
    cuda_only: bool = False
    alone: bool = True

    def run(self, ctx: Context, gated: bool = True) -> None:
        if self.measure:
            ctx.measure(self.name, lambda: self.fn(ctx), reserve_s=self.reserve_s if gated else 0.0,
                        cuda=self.cuda_only)  # fmt: skip
            return
        left = ctx.budget_s - ctx.elapsed()
        if gated and ctx.cuda and left < self.need_s:
            msg = f"(time budget: {left:.0f} s left; GPU_CHECK_ONLY={self.name} runs it alone)"
            ctx._verdict(self.name, "SKIP", msg)
            return
        ctx.check(self.name, lambda: self.fn(ctx), cuda=self.cuda)


# The full run, in order. Each measure after the checks starts only with at least reserve_s
# left of the budget: what the rest needs. The families' checks come last, each only if what
# it needs on an H200 is left: the measures keep their share of the budget.
STEPS = [
    Step("matmul_peak", measure_matmul_peak, measure=True),
    Step("flex_compile", measure_flex_compile, measure=True),
    Step("cuda_paths", check_cuda_paths, cuda="exercise"),
    Step("cpu_reference_losses", check_reference_losses, cuda="exercise"),
    Step("no_unnamed_syncs", check_sync_debug, cuda="require"),
    Step("pipeline_equals_serial", check_pipeline_equals_serial, alone=False),
    Step("bench_setup", measure_bench_setup, measure=True, reserve_s=90),
    Step("target_forward", measure_target_forward, measure=True, reserve_s=70),
    Step("drafter_step", measure_drafter_step, measure=True, reserve_s=60),
    Step("pipeline_vs_serial", measure_pipeline_vs_serial, measure=True, reserve_s=40),
    Step("peak_memory", measure_peak_memory, measure=True, cuda_only=True, alone=False),
    Step("families", check_families, need_s=170),
    Step("families_syncs", check_families_syncs, cuda="require", need_s=80),
]


# -- main --------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu_check"),
                    help="where gpu_check.json goes")  # fmt: skip
    ap.add_argument("--work", default=None, help="run folders, traces and reports (default: --out)")
    args = ap.parse_args()
    dry = os.environ.get("DRY_RUN", "0") == "1"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else out
    work.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not dry
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S", "320" if cuda else "3600"))
    ctx = Context(out, dry, "cuda:0" if cuda else "cpu", budget, work)
    import transformers

    from dflash.config import PipelineConfig

    ctx.info = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                "transformers": transformers.__version__, "python": platform.python_version(),
                "sync_debug_key": "sync_debug" in PipelineConfig.model_fields}  # fmt: skip
    ctx.say("INFO", "gpu_check", "dry run (CPU, tiny shapes)" if dry else "", f"device {ctx.info['device']},",
            f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()};",
            f"results in {out}" + (f", runs in {work}" if work != out else ""))  # fmt: skip
    if not dry and not cuda:
        ctx._verdict("cuda", "FAIL", "no CUDA device here (DRY_RUN=1 checks the script on CPU)")
    elif os.environ.get("GPU_CHECK_ONLY"):
        steps = {st.name: st for st in STEPS if st.alone}
        for name in os.environ["GPU_CHECK_ONLY"].split():
            if name in steps:
                steps[name].run(ctx, gated=False)
            else:
                msg = f"GPU_CHECK_ONLY: no check or measure named {name!r} (one of {sorted(steps)})"
                ctx._verdict(name, "FAIL", msg)
    else:
        for st in STEPS:
            st.run(ctx)
    res = ctx.save(partial=False)
    print(json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
