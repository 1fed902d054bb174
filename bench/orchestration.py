"""Orchestration efficiency: the real coordinator with synthetic stages of known cost.

    .venv/bin/python bench/orchestration.py              # every point
    .venv/bin/python bench/orchestration.py --quick      # the ≤ 10 % host-share points only
    .venv/bin/python bench/orchestration.py --quick --model async   # ... with CUDA-like devices
    .venv/bin/python bench/orchestration.py --quick --set pipeline.in_order=true   # drafters in prefetch's order

Each stage does host_ms of GIL-holding Python work (a counted loop) and device_ms of
GIL-free device work, in a real run's proportions: target forward + pack 135 ms per
batch, drafter forward + backward 48 ms per micro-batch, grad-norm sync and step 13 ms per
optimizer step. Only the compute is replaced: channels, devices, stages, profiler and
coordinator are the real ones. Two device models (`bench/simulated.py`): "sync" (the
thread waits out device_ms: host and device never overlap) and "async" (CUDA semantics:
device work is launched on a simulated in-order queue and waited for only where the real
code synchronizes). Steady state is the middle 60 % of the steps; fill and drain apart.

Bounds in batches/s, per model (h = host share, T, D, O = stage times above):
- target role: n_t / T (sync) or n_t / max(h·T, (1-h)·T) (async: launch overlaps device);
- drafter role: n_d / (D + O) — a replica waits for the step's update before its next
  forward, so its forward/backward and the optimizer step never overlap;
- GIL: 1 / (h · (T + D + O / n_d)) — one process, one interpreter lock;
- bound = the lowest of them; efficiency = steady throughput / bound;
- serial loop: 1 / (T + D + O / n_d) (sync: every stage one after another).
GIL load = steady throughput × Σ host time per batch: the share of wall time some stage
holds the interpreter lock (the orchestration's own share comes on top). Also measures
the orchestration's own CPU cost per batch (zero-cost stages). Medians of `--repeat` runs
(3) at host shares ≤ 10 %; the load average at the start is recorded, since other work
on a small machine moves these figures. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import simulated  # noqa: E402
from simulated import StageCost, SyntheticSpec, calibrate  # noqa: E402

from dflash import Coordinator, load_config  # noqa: E402

T_MS, D_MS, O_MS = 135.0, 48.0, 13.0


def _config(n_t: int, n_d: int, out: Path, extra: list[str]):  # type: ignore[no-untyped-def]
    return load_config(
        ROOT / "configs" / "tiny.toml",
        [
            f'run.output_dir="{out}"', "train.log_every=1", "profile.interval_s=1",
            f"pipeline.target_devices={json.dumps(['cpu'] * n_t)}",
            f"pipeline.drafter_devices={json.dumps(['cpu'] * n_d)}",
            "pipeline.hs_queue_depth=16", "pipeline.batch_queue_depth=8", *extra,
        ],
    )  # fmt: skip


def bounds(n_t: int, n_d: int, host: float, model: str, scale: float = 1.0) -> dict[str, float]:
    T, D, Opt = T_MS * scale, D_MS * scale, O_MS * scale
    t_cycle = T if model == "sync" else max(host, 1 - host) * T
    per_batch = T + D + Opt / n_d
    return {
        "target": n_t / (t_cycle / 1000),
        "drafter": n_d / ((D + Opt) / 1000),
        "gil": 1 / (host * per_batch / 1000) if host > 0 else float("inf"),
        "serial": 1 / (per_batch / 1000),
    }


def measure(
    n_t: int, n_d: int, host: float, batches: int, out: Path, extra: list[str], model: str, scale: float = 1.0
) -> dict:
    T, D, Opt = T_MS * scale, D_MS * scale, O_MS * scale
    spec = SyntheticSpec(
        StageCost(T * host, T * (1 - host)), StageCost(D * host, D * (1 - host)),
        StageCost(Opt * host, Opt * (1 - host)), batches=batches, device_model=model,  # type: ignore[arg-type]
    )  # fmt: skip
    times: list[float] = []
    cfg, training = simulated.prepare(_config(n_t, n_d, out, extra), spec)
    coord = Coordinator(cfg, log=False, training=training, make_device=simulated.device_factory(spec))
    coord.subscribe(lambda r: times.append(time.perf_counter()) if r["event"] == "train_step" else None)
    t0 = time.perf_counter()
    asyncio.run(coord.run())
    t_end = time.perf_counter()
    n = len(times)
    a, b = int(n * 0.2), int(n * 0.8)
    steady = (b - a) * n_d / (times[b] - times[a])
    bd = bounds(n_t, n_d, host, model, scale)
    bound = min(bd["target"], bd["drafter"], bd["gil"])
    return {
        "steady_batches_s": steady, "efficiency": steady / bound, "vs_serial": steady / bd["serial"],
        "fill_s": times[0] - t0, "drain_s": t_end - times[-1], "bound": bound,
        "limit": min(("target", "drafter", "gil"), key=lambda k: bd[k]), **{f"{k}_bound": v for k, v in bd.items()},
    }  # fmt: skip


def point(
    n_t: int, n_d: int, host: float, model: str, repeat: int, tmp: Path, extra: list[str] | None = None, **kw: int
) -> dict:
    batches = kw.get("batches") or (300 if n_t > 1 else 100)
    runs = [measure(n_t, n_d, host, batches, tmp / f"r{i}", extra or [], model) for i in range(repeat)]
    eff = [r["efficiency"] for r in runs]
    med = sorted(runs, key=lambda r: r["efficiency"])[len(runs) // 2]
    return {
        "topology": f"{n_t}+{n_d}", "model": model, "host_share": host, "extra": extra or [],
        "efficiency": round(statistics.median(eff), 3), "efficiency_runs": [round(e, 3) for e in eff],
        "steady_batches_s": round(med["steady_batches_s"], 2), "bound": round(med["bound"], 2),
        "limit": med["limit"], "target_bound": round(med["target_bound"], 2),
        "drafter_bound": round(med["drafter_bound"], 2), "gil_bound": round(med["gil_bound"], 2),
        "vs_serial": round(med["vs_serial"], 2), "fill_s": round(med["fill_s"], 2), "drain_s": round(med["drain_s"], 2),
        "gil_load": round(med["steady_batches_s"] / med["gil_bound"], 3),
    }  # fmt: skip


def overhead(n_t: int, n_d: int, tmp: Path, batches: int = 600) -> dict:
    """CPU seconds the process spends per batch when every stage costs nothing: the
    coordinator's, channels' and profiler's own share of the GIL."""
    spec = SyntheticSpec(StageCost(0, 0), StageCost(0, 0), StageCost(0, 0), batches=batches)
    cfg, training = simulated.prepare(_config(n_t, n_d, tmp, []), spec)
    coord = Coordinator(cfg, log=False, training=training, make_device=simulated.device_factory(spec))
    c0, w0 = time.process_time(), time.perf_counter()
    asyncio.run(coord.run())
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {
        "topology": f"{n_t}+{n_d}", "cpu_us_per_batch": round(cpu / batches * 1e6), "batches_s": round(batches / wall),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per point (the median is reported)")
    ap.add_argument("--quick", action="store_true", help="only the ≤ 10 %% host-share points (sync model by default)")
    ap.add_argument("--model", choices=("sync", "async", "both"), default=None,
                    help="device model(s) to run (default: sync with --quick, else both)")  # fmt: skip
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every point, e.g. pipeline.in_order=true")  # fmt: skip
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    calibrate()
    load0 = os.getloadavg()[0]
    if load0 > 0.5:
        print(f"note: load average {load0:.2f} before the start; other work moves these figures", file=sys.stderr)
    shares = (0.02, 0.05, 0.10) if args.quick else (0.02, 0.05, 0.10, 0.30, 0.50)
    model_arg = args.model or ("sync" if args.quick else "both")
    models = ("sync", "async") if model_arg == "both" else (model_arg,)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        over = [overhead(5, 3, tmp / "o53"), overhead(1, 1, tmp / "o11")]
        for model in models:
            for n_t, n_d in ((5, 3), (1, 1)):
                for host in shares:
                    rep = args.repeat if host <= 0.10 else 1
                    rows.append(point(n_t, n_d, host, model, rep, tmp / f"{model}{n_t}{n_d}{host}", args.overrides))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if not args.quick:
            for extra in (
                ["pipeline.hs_queue_depth=1"],
                ["pipeline.hs_queue_depth=2"],
                ["pipeline.hs_queue_depth=64"],
                ["pipeline.hs_min_ready=10"],
                ["pipeline.batch_queue_depth=1"],
            ):
                rows.append(point(5, 3, 0.05, "sync", 1, tmp / "sweep", extra))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{'topo':5} {'model':5} {'host':>5} {'steady b/s':>10} {'bound':>7} {'limit':>7} {'GIL':>7} "
          f"{'eff':>6} {'runs':>19} {'xserial':>7} {'fill s':>6} {'GIL load':>8}  extra")  # fmt: skip
    for r in rows:
        runs = "/".join(f"{e:.3f}" for e in r["efficiency_runs"])
        print(f"{r['topology']:5} {r['model']:5} {r['host_share']:>5.2f} {r['steady_batches_s']:>10.2f} "
              f"{r['bound']:>7.2f} {r['limit']:>7} {r['gil_bound']:>7.2f} {r['efficiency']:>6.3f} {runs:>19} "
              f"{r['vs_serial']:>7.2f} {r['fill_s']:>6.2f} {r['gil_load']:>8.2f}  {' '.join(r['extra'])}")  # fmt: skip
    for o in over:
        print(f"orchestration cost, {o['topology']}: {o['cpu_us_per_batch']} µs CPU per batch "
              f"(zero-cost stages: {o['batches_s']} batches/s)")  # fmt: skip
    print(json.dumps({"bench": "orchestration", "rows": rows, "overhead": over, "load_avg_start": load0}))


if __name__ == "__main__":
    main()
