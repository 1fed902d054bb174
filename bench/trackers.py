"""What the experiment trackers cost a run: the subscriber's time per record on the loop thread
(all four trackers on: TensorBoard, wandb offline, MLflow in SQLite, Trackio), and the tiny
config's tokens/s with and without them over alternating runs.

    .venv/bin/python bench/trackers.py            # 3 runs each way
    .venv/bin/python bench/trackers.py --pairs 5

Part 1 times `Trackers.__call__` (records in, scalars onto the writer's queue) in one tracked run
in this process: median and p99 in µs over every record. Part 2 runs `bin/dflash run
configs/tiny.toml` (256 steps, no end-of-run eval) with `--tracker` × 4 and without, alternating,
and reads `run_end`'s tokens/s. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FOUR = ["tensorboard", "wandb", "mlflow", "trackio"]


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "offline", "TRACKIO_DIR": str(tmp / "trackio")}


def per_record(tmp: Path) -> dict:
    """The subscriber's µs per record, in a tracked run of this process."""
    os.environ.update(_env(tmp))
    import dflash
    from dflash.trackers import Trackers

    took: list[float] = []
    call = Trackers.__call__

    def timed(self, record):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter_ns()
        call(self, record)
        took.append((time.perf_counter_ns() - t0) / 1000)

    Trackers.__call__ = timed  # type: ignore[method-assign]
    sets = [f'run.output_dir="{tmp}"', 'run.name="timed"', f"run.trackers={json.dumps(FOUR)}", "eval.at_end=false",
            "train.max_steps=128", "profile.interval_s=0.5"]  # fmt: skip
    asyncio.run(dflash.Coordinator(dflash.load_config(ROOT / "configs" / "tiny.toml", sets), log=False).run())
    Trackers.__call__ = call  # type: ignore[method-assign]
    took.sort()
    return {"records": len(took), "median_us": round(statistics.median(took), 1),
            "p99_us": round(took[min(len(took) - 1, int(0.99 * len(took)))], 1)}  # fmt: skip


def tokens_per_s(tmp: Path, tracked: bool, i: int) -> float:
    sets = ["--set", f'run.output_dir="{tmp}"', "--set", f'run.name="r{i}{"t" if tracked else "p"}"', "--set",
            "eval.at_end=false"]  # fmt: skip
    extra = [a for t in FOUR for a in ("--tracker", t)] if tracked else []
    proc = subprocess.run([sys.executable, "-m", "dflash", "run", str(ROOT / "configs" / "tiny.toml"), *sets, *extra],
                          capture_output=True, text=True, cwd=ROOT, env=_env(tmp), timeout=900)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    end = next(json.loads(x) for x in proc.stdout.splitlines() if '"run_end"' in x)
    return float(end["tokens_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dflash-trackers-"))
    cost = per_record(tmp)
    print(f"subscriber: {cost['records']} records, median {cost['median_us']} µs, p99 {cost['p99_us']} µs", flush=True)
    on, off = [], []
    for i in range(a.pairs):
        off.append(tokens_per_s(tmp, False, i))
        on.append(tokens_per_s(tmp, True, i))
        print(f"pair {i}: off {off[-1]:.0f} tok/s, on {on[-1]:.0f} tok/s", flush=True)
    ratio = statistics.median(on) / statistics.median(off)
    print(json.dumps({"bench": "trackers", **cost, "tokens_per_s_off": off, "tokens_per_s_on": on,
                      "on_over_off": round(ratio, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
