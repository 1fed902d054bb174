"""The benchmark scripts themselves keep working (their figures live in BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_script_dry_run_on_cpu(tmp_path: Path) -> None:
    """DRY_RUN=1 runs bench/gpu_check.sh end to end on CPU with tiny shapes: both modes, the
    reports, and the final JSON line — so the script is sound before a GPU is at hand."""
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["bench"] == "gpu_check" and last["ratio"] > 0
    assert last["pipeline"]["steps"] == last["serial"]["steps"] == 6
    for mode in ("pipeline", "serial"):
        assert (tmp_path / f"{mode}.trace.json").is_file() and (tmp_path / f"{mode}.report.txt").is_file()


def test_orchestration_bench_measures_a_point(tmp_path: Path) -> None:
    """bench/orchestration.py's measurement on a short run: sane bounds and efficiency."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("orchestration", ROOT / "bench" / "orchestration.py")
    assert spec is not None and spec.loader is not None
    orch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(orch)
    b = orch.bounds(5, 3, 0.1, "sync")
    assert abs(b["target"] - 5 / 0.135) < 1e-9 and abs(b["drafter"] - 3 / 0.061) < 1e-9
    assert orch.bounds(5, 3, 0.1, "async")["target"] > b["target"]  # launch overlaps device work
    # sync: no run-ahead, so even a short run cannot beat its bound (async may, while a
    # backlog of hidden states drains — which is why the bench runs 100–300 batches)
    row = orch.point(1, 1, 0.05, "sync", 1, tmp_path, None, batches=16)
    assert row["limit"] == "target" and 0.5 < row["efficiency"] < 1.02 and row["fill_s"] > 0
