"""What profiling costs: per record (µs), the FLOP and MFU accounting per step (µs, and
its share of a step), and on throughput (profiling on vs off, MFU on vs off).

    .venv/bin/python bench/profiler_overhead.py            # the tiny config, 3 runs each way
    .venv/bin/python bench/profiler_overhead.py --runs 5

The MFU accounting of one step: the target's FLOPs from its batch, the drafter's from its
prepared batch (shapes only), three `Profiler.add_flops` calls and the optimizer's, and a
window's `roofline` summary shared over the steps of a 10 s window — timed over many
repetitions on a real tiny batch. Throughput runs alternate (so that machine drift hits all
alike) on the tiny config and compare the median tokens/s. Prints a table, then one JSON line.
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

import torch  # noqa: E402


def per_record_us(n: int, trace: bool) -> float:
    from dflash.runtime.profiler import Profiler, Trace

    p = Profiler(1e9, lambda ev, **kw: None, trace=Trace("/dev/null", n + 1) if trace else None)
    t0 = time.perf_counter()
    for i in range(n):
        p.record("drafter.forward", 0.001, worker="drafter0") if i % 2 else p.record("target.model_forward", 0.002)
    return (time.perf_counter() - t0) / n * 1e6


def mfu_step_us(n: int) -> tuple[float, float]:
    """µs the MFU accounting adds to a step (one batch a step), and a step's ms on this run."""
    from dflash.config import load_config
    from dflash.roofline import flops
    from dflash.runtime.devices import Device
    from dflash.runtime.messages import HostFeatures
    from dflash.runtime.profiler import Profiler, Stage, roofline
    from dflash.stages.prefetch import next_batch
    from dflash.train.build import build_training

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(ROOT / "configs" / "tiny.toml", [f'run.output_dir="{d}"', "eval.at_end=false"])
        training = build_training(cfg)
    batch = next_batch(iter(training.plan), pin=False)
    target, rep = training.targets[0], training.replicas[0]
    layers, _ = target.of_batch(batch)
    dev = Device("cpu", "drafter0")
    prepared = training.micro.prepare(rep, dev, HostFeatures(batch, torch.cat(layers, -1), 0), 0)
    t0 = time.perf_counter()
    training.micro.compute(rep, dev, prepared)
    step_ms = (time.perf_counter() - t0) * 1000
    p = Profiler(1e9, lambda ev, **kw: None)
    chunk = training.micro.loss.chunk
    t0 = time.perf_counter()
    for _ in range(n):
        p.add_flops(Stage.TARGET_FORWARD, flops.of_target(target, batch), "cpu")
        work = flops.of_prepared(rep, prepared, chunk)
        p.add_flops(Stage.DRAFTER_FORWARD, work.forward, "cpu")
        p.add_flops(Stage.DRAFTER_BACKWARD, work.backward, "cpu")
        p.add_flops(Stage.OPTIMIZER_STEP, flops.optimizer(rep.num_params), "cpu")
    per_step = (time.perf_counter() - t0) / n * 1e6
    stages = {s: {"count": 300, "mean_ms": 10.0, "total_s": 3.0} for s in Stage.timed()}
    done = {(s, "cpu"): 1e9 for s in (Stage.TARGET_FORWARD, Stage.DRAFTER_FORWARD, Stage.DRAFTER_BACKWARD)}
    t0 = time.perf_counter()
    for _ in range(200):
        roofline({k: dict(v) for k, v in stages.items()}, done, {}, 1e6)
    window_us = (time.perf_counter() - t0) / 200 * 1e6
    return per_step + window_us / 300, step_ms  # a 10 s window of ~33 ms steps: ~300 steps


def run_tokens_per_s(enabled: bool, out: Path, mfu: bool = True) -> float:
    cmd = [
        str(ROOT / "bin" / "dflash"), "run", str(ROOT / "configs" / "tiny.toml"),
        "--set", f'run.output_dir="{out}"', "--set", f"profile.enabled={'true' if enabled else 'false'}",
        "--set", f"profile.mfu={'true' if mfu else 'false'}",
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
    mfu_us, step_ms = mfu_step_us(2000)
    on: list[float] = []
    off: list[float] = []
    no_mfu: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.runs):
            on.append(run_tokens_per_s(True, Path(d) / f"on{i}"))
            no_mfu.append(run_tokens_per_s(True, Path(d) / f"nomfu{i}", mfu=False))
            off.append(run_tokens_per_s(False, Path(d) / f"off{i}"))
    m_on, m_off, m_no = statistics.median(on), statistics.median(off), statistics.median(no_mfu)
    share = mfu_us / 1000 / step_ms
    print(f"{'what':40} {'figure':>12}")
    print(f"{'Profiler.record, no trace (µs)':40} {rec:>12.2f}")
    print(f"{'Profiler.record, with trace (µs)':40} {rec_trace:>12.2f}")
    print(f"{'tiny run, profiling on (median tok/s)':40} {m_on:>12.0f}")
    print(f"{'tiny run, profiling off (median tok/s)':40} {m_off:>12.0f}")
    print(f"{'on / off':40} {m_on / m_off:>12.3f}")
    print(f"{'MFU accounting a step (µs)':40} {mfu_us:>12.2f}")
    print(f"{'... its share of a tiny step':40} {100 * share:>11.3f}%")
    print(f"{'tiny run, profiling on, MFU off (tok/s)':40} {m_no:>12.0f}")
    print(f"{'MFU on / off':40} {m_on / m_no:>12.3f}")
    print(json.dumps({"bench": "profiler_overhead", "record_us": round(rec, 3), "record_trace_us": round(rec_trace, 3),
                      "mfu_step_us": round(mfu_us, 3), "step_ms": round(step_ms, 3), "mfu_share": round(share, 6),
                      "tok_s_on": on, "tok_s_off": off, "tok_s_no_mfu": no_mfu, "ratio_on_off": round(m_on / m_off, 4),
                      "ratio_mfu_on_off": round(m_on / m_no, 4)}))  # fmt: skip


if __name__ == "__main__":
    main()
