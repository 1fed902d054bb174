"""`dflash report` names the bottleneck from a run's own log."""

from __future__ import annotations

import json

import pytest

from dflash.report import analyze, read_records
from tests.conftest import CliRun, dflash


def _profile(
    window: int, warmup: bool, stages: dict[str, float], wall: float = 10.0, workers: dict[str, float] | None = None
) -> dict:
    rec = {
        "event": "profile", "window": window, "warmup": warmup, "final": False, "wall_s": wall,
        "stages": {k: {"count": 10, "total_s": v, "mean_ms": 100 * v, "max_ms": 200 * v, "p50_ms": 1, "p95_ms": 2}
                   for k, v in stages.items()},
        "queues": {}, "tokens_per_s": {"target": 100.0, "drafter": 100.0},
    }  # fmt: skip
    if workers is not None:
        rec["workers"] = workers
    return rec


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


@pytest.mark.parametrize(
    ("busiest", "role"),
    [
        ("data.prefetch", "data"),
        ("target.pack_hidden", "target"),
        ("drafter.backward", "drafter"),
        ("dflash.create_block_mask", "drafter"),
        ("drafter.grad_norm_sync", "optimizer"),
        ("drafter.optimizer_step", "optimizer"),
    ],
)
def test_busiest_role_is_the_bottleneck(busiest: str, role: str):
    """Without per-worker figures, the role whose stages are busiest is named; stages go to
    the role of the worker that runs them (grad sync and step: the optimizer thread), and a
    long wait is idle time, never the bottleneck."""
    stages = {"data.prefetch": 1.0, "target.model_forward": 2.0, "drafter.forward": 2.0,
              "drafter.optimizer_step": 1.0, "drafter.queue_wait": 9.5}  # fmt: skip
    stages[busiest] = stages.get(busiest, 0.0) + 5.0
    a = analyze([_profile(0, False, stages)])
    assert a["bottleneck"] == role, a["busy"]
    assert max(a["busy"], key=a["busy"].get) == role


def test_busiest_worker_wins_over_summed_roles():
    """With per-worker busy fractions, the busiest worker names the bottleneck (its role,
    without the index), even where several replicas of another role add up to more; the
    event loop being busiest is no verdict, so the roles decide."""
    stages = {"target.model_forward": 12.0, "drafter.forward": 8.0}  # two target chains: 0.6 + 0.6
    a = analyze([_profile(0, False, stages, workers={"target0": 0.6, "target1": 0.6, "drafter0": 0.8})])
    assert a["busy"]["target"] > a["busy"]["drafter"]
    assert a["bottleneck"] == "drafter" and a["bound_tokens_per_s"] == round(100 / 0.8, 2)
    a = analyze([_profile(0, False, stages, workers={"loop": 0.9, "target0": 0.6, "drafter0": 0.8})])
    assert a["bottleneck"] == "target"


def test_report_cli_on_a_real_log(cli_run: CliRun):
    """`dflash report --json` reads a real run's log from stdin and prints exactly the
    analysis of that log (a bottleneck named, the drafter's stages timed); the table names
    the same bottleneck; a line that is not JSON is a one-line error naming the line."""
    assert cli_run.proc.returncode == 0, cli_run.proc.stderr
    text = cli_run.log.read_text(encoding="utf-8")
    expected = analyze(read_records(text.splitlines(), "log"))
    out = dflash("report", "--json", input=text)
    assert out.returncode == 0, out.stderr
    a = json.loads(out.stdout)
    assert a == json.loads(json.dumps(expected))
    assert a["bottleneck"] is not None
    assert "drafter.forward" in a["stages"] and a["wall_s"] > 0
    table = dflash("report", str(cli_run.log))
    assert table.returncode == 0, table.stderr
    assert f"bottleneck: {a['bottleneck']} (" in table.stdout
    bad = dflash("report", input="not json\n")
    assert bad.returncode == 1 and bad.stderr.startswith("dflash: error: <stdin>:1")


def test_report_cli_names_the_bottleneck_of_a_log(tmp_path):
    """`dflash report LOG` on a log whose optimizer is busiest says so in its table."""
    log = tmp_path / "log.jsonl"
    recs = [_profile(0, False, {"target.model_forward": 3.0, "drafter.forward": 2.0, "drafter.optimizer_step": 7.0})]
    log.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    out = dflash("report", str(log))
    assert out.returncode == 0, out.stderr
    assert "bottleneck: optimizer (70% busy)" in out.stdout


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
