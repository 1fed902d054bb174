"""`dflash report` names the bottleneck from a run's own log."""

from __future__ import annotations

import json
import subprocess

import pytest

from dflash.report import analyze
from tests.conftest import ROOT


def _profile(window: int, warmup: bool, stages: dict[str, float], wall: float = 10.0) -> dict:
    return {
        "event": "profile", "window": window, "warmup": warmup, "final": False, "wall_s": wall,
        "stages": {k: {"count": 10, "total_s": v, "mean_ms": 100 * v, "max_ms": 200 * v, "p50_ms": 1, "p95_ms": 2}
                   for k, v in stages.items()},
        "queues": {}, "tokens_per_s": {"target": 100.0, "drafter": 100.0},
    }  # fmt: skip


def test_target_bound_run_is_diagnosed():
    """Targets busy 9 s of 10, drafters waiting on the queue: the target is the bottleneck, drafters starved."""
    recs = [
        _profile(0, True, {"target.model_forward": 1.0}),  # warm-up: dropped
        _profile(1, False, {"target.model_forward": 9.0, "drafter.forward": 2.0, "drafter.queue_wait": 6.0}),
    ]
    a = analyze(recs)
    assert a["warmup_windows_dropped"] == 1 and a["bottleneck"] == "target"
    assert a["waits"]["drafter.queue_wait"] == 0.6
    assert a["bound_tokens_per_s"] == round(100 / 0.9, 2)


def test_report_cli_on_a_real_log(tmp_path):
    """`dflash report` reads a real run's log from stdin and prints a table and a bottleneck."""
    log = tmp_path / "log.jsonl"
    run = subprocess.run(
        [str(ROOT / "bin" / "dflash"), "run", str(ROOT / "configs" / "tiny.toml"),
         "--set", f'run.output_dir="{tmp_path}"', "--set", "data.num_samples=64",
         "--set", "eval.at_end=false", "--profile-interval", "0.5", "--log-file", str(log)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = subprocess.run([str(ROOT / "bin" / "dflash"), "report", "--json"], input=log.read_text(),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    a = json.loads(out.stdout)
    assert a["bottleneck"] in {"target", "drafter", "optimizer", "data"}
    assert "drafter.forward" in a["stages"] and a["wall_s"] > 0
    bad = subprocess.run([str(ROOT / "bin" / "dflash"), "report"], input="not json\n", capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("dflash: error: <stdin>:1")


def test_plot_writes_a_png(tmp_path):
    """--plot draws stage times and queue depth into a PNG."""
    pytest.importorskip("matplotlib")
    from dflash.report import plot

    recs = [_profile(i, i == 0, {"target.model_forward": 9.0, "drafter.forward": 2.0}) for i in range(3)]
    for r in recs:
        r["queues"] = {"hidden_states": {"mean_depth": 1.0, "max_depth": 2}}
    out = tmp_path / "p.png"
    plot(recs, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
