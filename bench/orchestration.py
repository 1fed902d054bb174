"""Orchestration efficiency: the real coordinator with synthetic stages of known cost.

    .venv/bin/python bench/orchestration.py          # ~3 minutes on 2 CPU cores

Each stage does host_ms of GIL-holding Python work (a counted loop) and device_ms of
GIL-free waiting (like a GPU kernel), in the seed's proportions scaled from seconds to
10 ms units: target forward + pack 13.5 s → 135 ms per batch, drafter forward + backward
4.8 s → 48 ms per micro-batch, grad-norm sync and step 1.3 s → 13 ms per optimizer step.
Only the compute is replaced: channels, devices, stages, profiler and coordinator are the
real ones. Steady state is the middle 60 % of the steps (fill and drain reported apart).

Bounds (batches/s): device = min(n_t / t_target, n_d / t_drafter, n_d / t_opt);
GIL = 1 / Σ host time per batch (one process, one interpreter lock); serial loop =
1 / (t_target + t_drafter + t_opt / n_d). Efficiency = steady throughput / min(device, GIL).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash import Coordinator, load_config  # noqa: E402
from dflash.synthetic import StageCost, SyntheticSpec, calibrate  # noqa: E402

T_MS, D_MS, O_MS = 135.0, 48.0, 13.0


def measure(n_t: int, n_d: int, host: float, batches: int, out: Path, extra: list[str] | None = None) -> dict:
    cfg = load_config(
        ROOT / "configs" / "tiny.toml",
        [
            f'run.output_dir="{out}"', "train.log_every=1", "profile.interval_s=1",
            f"pipeline.target_devices={json.dumps(['cpu'] * n_t)}",
            f"pipeline.drafter_devices={json.dumps(['cpu'] * n_d)}",
            "pipeline.hs_queue_depth=16", "pipeline.batch_queue_depth=8", *(extra or []),
        ],
    )  # fmt: skip
    spec = SyntheticSpec(
        StageCost(T_MS * host, T_MS * (1 - host)), StageCost(D_MS * host, D_MS * (1 - host)),
        StageCost(O_MS * host, O_MS * (1 - host)), batches=batches,
    )  # fmt: skip
    times: list[float] = []
    coord = Coordinator(cfg, log=False, synthetic=spec)
    coord.subscribe(lambda r: times.append(time.perf_counter()) if r["event"] == "train_step" else None)
    t0 = time.perf_counter()
    asyncio.run(coord.run())
    t_end = time.perf_counter()
    n = len(times)
    a, b = int(n * 0.2), int(n * 0.8)
    steady = (b - a) * n_d / (times[b] - times[a])
    device = min(n_t / (T_MS / 1000), n_d / (D_MS / 1000), n_d / (O_MS / 1000))
    gil = 1 / (host * (T_MS + D_MS + O_MS / n_d) / 1000)
    serial = 1 / ((T_MS + D_MS + O_MS / n_d) / 1000)
    bound = min(device, gil)
    return {
        "topology": f"{n_t}+{n_d}", "host_share": host, "steady_batches_s": round(steady, 2),
        "device_bound": round(device, 2), "gil_bound": round(gil, 2), "efficiency": round(steady / bound, 3),
        "vs_serial": round(steady / serial, 2), "fill_s": round(times[0] - t0, 2),
        "drain_s": round(t_end - times[-1], 2),
        "extra": extra or [],
    }  # fmt: skip


def main() -> None:
    calibrate()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n_t, n_d, batches in ((5, 3, 300), (1, 1, 100)):
            for host in (0.02, 0.05, 0.10, 0.30, 0.50):
                rows.append(measure(n_t, n_d, host, batches, Path(d) / f"{n_t}{n_d}{host}"))
        for extra in (["pipeline.hs_queue_depth=2"], ["pipeline.hs_queue_depth=16", "pipeline.hs_min_ready=10"]):
            rows.append(measure(5, 3, 0.05, 300, Path(d) / "sweep", extra))
    print(f"{'topo':5} {'host':>5} {'steady b/s':>10} {'device':>7} {'GIL':>7} {'eff':>6} {'xserial':>7} "
          f"{'fill s':>6} {'drain s':>7}  extra")  # fmt: skip
    for r in rows:
        print(f"{r['topology']:5} {r['host_share']:>5.2f} {r['steady_batches_s']:>10.2f} {r['device_bound']:>7.2f} "
              f"{r['gil_bound']:>7.2f} {r['efficiency']:>6.3f} {r['vs_serial']:>7.2f} {r['fill_s']:>6.2f} "
              f"{r['drain_s']:>7.2f}  {' '.join(r['extra'])}")  # fmt: skip
    print(json.dumps({"bench": "orchestration", "rows": rows}))


if __name__ == "__main__":
    main()
