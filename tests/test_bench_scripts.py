"""The benchmark scripts themselves keep working (their figures live in BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import CLI_TIMEOUT_S, ROOT


def test_gpu_check_script_dry_run_on_cpu(tmp_path: Path) -> None:
    """DRY_RUN=1 runs bench/gpu_check.sh end to end on CPU with tiny shapes: both modes, the
    reports, and the final JSON line — so the script is sound before a GPU is at hand."""
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["bench"] == "gpu_check" and last["ratio"] > 0
    assert last["pipeline"]["steps"] == last["serial"]["steps"] == 6
    for mode in ("pipeline", "serial"):
        assert (tmp_path / f"{mode}.trace.json").is_file() and (tmp_path / f"{mode}.report.txt").is_file()


def _orchestration() -> ModuleType:
    spec = importlib.util.spec_from_file_location("orchestration", ROOT / "bench" / "orchestration.py")
    assert spec is not None and spec.loader is not None
    orch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(orch)
    return orch


def test_orchestration_bounds() -> None:
    """bench/orchestration.py's bounds: the sync target bound is one batch per T, launch
    overlapping device work raises it (async), the drafter's is n_d / (D + O)."""
    orch = _orchestration()
    b = orch.bounds(5, 3, 0.1, "sync")
    assert abs(b["target"] - 5 / 0.135) < 1e-9 and abs(b["drafter"] - 3 / 0.061) < 1e-9
    assert orch.bounds(5, 3, 0.1, "async")["target"] > b["target"]  # launch overlaps device work


class StepClock:
    """The bench's clock, read once at the start, once per train_step, once at the end:
    returns these readings in turn, and fails on one reading too many."""

    def __init__(self, readings: list[float]) -> None:
        self.readings = list(readings)

    def perf_counter(self) -> float:
        assert self.readings, "the bench read its clock more often than once per step"
        return self.readings.pop(0)


def test_orchestration_bench_measures_a_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/orchestration.py's point() runs the real coordinator with synthetic stages and
    turns the train_step times into its figures: steady throughput over the middle 60 % of
    the steps (20 %..80 %), efficiency = steady / bound, fill = start to first step, drain =
    last step to end. The step times come from a fake clock, so the figures are exact on
    any machine: steps at the bound's rate in the middle, five times slower outside it."""
    orch = _orchestration()
    n, a, b = 10, 2, 8  # 10 steps; the steady part runs from step int(0.2 n) to step int(0.8 n)
    dt = 1 / orch.bounds(1, 1, 0.05, "sync")["target"]
    steps = [1.0]  # the first step 1 s after the start: fill
    for i in range(1, n):
        steps.append(steps[-1] + (dt if a < i <= b else 5 * dt))
    clock = StepClock([0.0, *steps, steps[-1] + 0.5])  # ends 0.5 s after the last step: drain
    monkeypatch.setattr(orch, "time", clock)
    row = orch.point(1, 1, 0.05, "sync", 1, tmp_path, None, batches=n)
    assert clock.readings == []  # one reading per step: every batch made a step
    assert row["limit"] == "target" and row["efficiency"] == 1.0 and row["efficiency_runs"] == [1.0]
    assert row["steady_batches_s"] == round(1 / dt, 2) and row["vs_serial"] == round((1 / dt) / (1000 / 196), 2)
    assert (row["fill_s"], row["drain_s"]) == (1.0, 0.5)
