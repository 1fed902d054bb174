"""What profiling costs: per record (µs), and on throughput (profiling on vs off).

    .venv/bin/python bench/profiler_overhead.py            # the tiny config, 3 runs each way
    .venv/bin/python bench/profiler_overhead.py --runs 5

Throughput runs alternate on / off (so that machine drift hits both alike) on the tiny
config and compare the median tokens/s. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def per_record_us(n: int, trace: bool) -> float:
    from dflash.runtime.profiler import Profiler, Trace

    p = Profiler(1e9, lambda ev, **kw: None, trace=Trace("/dev/null", n + 1) if trace else None)
    t0 = time.perf_counter()
    for i in range(n):
        p.record("drafter.forward", 0.001, worker="drafter0") if i % 2 else p.record("target.model_forward", 0.002)
    return (time.perf_counter() - t0) / n * 1e6


def run_tokens_per_s(enabled: bool, out: Path) -> float:
    cmd = [
        str(ROOT / "bin" / "dflash"), "run", str(ROOT / "configs" / "tiny.toml"),
        "--set", f'run.output_dir="{out}"', "--set", f"profile.enabled={'true' if enabled else 'false'}",
        "--set", "eval.at_end=false", "--set", "checkpoint.at_end=false", "--set", "checkpoint.export_final=false",
        "--set", "profile.interval_s=1.0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    end = json.loads(proc.stdout.strip().splitlines()[-1])
    return float(end["tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each kind (interleaved)")
    args = ap.parse_args()
    rec = per_record_us(200_000, trace=False)
    rec_trace = per_record_us(200_000, trace=True)
    on: list[float] = []
    off: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.runs):
            on.append(run_tokens_per_s(True, Path(d) / f"on{i}"))
            off.append(run_tokens_per_s(False, Path(d) / f"off{i}"))
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"{'what':40} {'figure':>12}")
    print(f"{'Profiler.record, no trace (µs)':40} {rec:>12.2f}")
    print(f"{'Profiler.record, with trace (µs)':40} {rec_trace:>12.2f}")
    print(f"{'tiny run, profiling on (median tok/s)':40} {m_on:>12.0f}")
    print(f"{'tiny run, profiling off (median tok/s)':40} {m_off:>12.0f}")
    print(f"{'on / off':40} {m_on / m_off:>12.3f}")
    print(json.dumps({"bench": "profiler_overhead", "record_us": round(rec, 3), "record_trace_us": round(rec_trace, 3),
                      "tok_s_on": on, "tok_s_off": off, "ratio_on_off": round(m_on / m_off, 4)}))  # fmt: skip


if __name__ == "__main__":
    main()
