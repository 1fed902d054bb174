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
