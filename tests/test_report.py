"""`dflash report` names the bottleneck from a run's own log."""

from __future__ import annotations

import json

import pytest

from dflash.errors import DataError
from dflash.report import analyze, format_report, read_records
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


def _on_gpu(rec: dict, device_ms: dict[str, float]) -> dict:
    """`rec`'s stages as a CUDA run writes them: with the mean device time of their events."""
    for name, ms in device_ms.items():
        rec["stages"][name]["device_mean_ms"] = ms
    return rec


def test_a_named_sync_waiting_for_the_gpu_is_not_the_optimizers_work():
    """On a GPU the grad-norm sync's host time is the wait for the device's queued work: only
    its device time is the optimizer's. Waiting more than any worker is busy makes the run
    GPU-bound: the drafter's device is named, with no host worker's bound on throughput."""
    stages = {"target.model_forward": 1.0, "drafter.forward": 0.5, "drafter.backward": 2.5,
              "drafter.grad_norm_sync": 5.4, "drafter.optimizer_step": 0.1}  # fmt: skip
    workers = {"target0": 0.1, "drafter0": 0.3, "optimizer": 0.55}
    rec = _on_gpu(_profile(0, False, stages, workers=workers), {"drafter.grad_norm_sync": 0.5})  # 10 × 0.5 ms
    a = analyze([rec])
    assert a["cuda"] and a["waits"]["drafter.grad_norm_sync"] == pytest.approx(0.5395)
    assert a["busy"]["optimizer"] == pytest.approx(0.0105) and a["workers"]["optimizer"] == pytest.approx(0.0105)
    assert a["bottleneck"] == "drafter" and a["gpu_bound"] == pytest.approx(0.5395)
    assert a["bound_tokens_per_s"] is None
    text = format_report(a)
    assert "bottleneck: the drafter's GPU" in text and "busiest host worker is drafter0 (30%)" in text
    assert "never idled" not in text and "GIL" not in text
    assert a["stages"]["drafter.grad_norm_sync"]["device_mean_ms"] == 0.5

    # A short wait leaves the verdict to the busiest worker, and is said apart.
    stages["drafter.grad_norm_sync"] = 1.0
    rec = _on_gpu(_profile(0, False, stages, workers={**workers, "optimizer": 0.11}), {"drafter.grad_norm_sync": 0.5})
    a = analyze([rec])
    assert a["bottleneck"] == "drafter" and a["gpu_bound"] is None and a["bound_tokens_per_s"] == round(100 / 0.3, 2)
    assert "the host waits for the GPU 10% of wall time" in format_report(a)

    # Several ranks: the sync also waits for the others' all-reduce, so it stays the optimizer's.
    ranked = [{**_on_gpu(_profile(0, False, {**stages, "drafter.grad_norm_sync": 5.4}, workers=workers),
                         {"drafter.grad_norm_sync": 0.5}), "rank": r} for r in (0, 1)]  # fmt: skip
    a = analyze(ranked)
    assert a["bottleneck"] == "optimizer" and a["gpu_bound"] is None and a["bound_tokens_per_s"] is not None
    assert all(r["bottleneck"] == "optimizer" for r in a["ranks"])

    # On a CPU the same stages are work: the optimizer's sync stays its own.
    a = analyze([_profile(0, False, {**stages, "drafter.grad_norm_sync": 5.4}, workers=workers)])
    assert not a["cuda"] and a["bottleneck"] == "optimizer" and a["gpu_bound"] is None


@pytest.mark.slow
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


def _rank_profile(rank: int, window: int, stages: dict[str, float], workers: dict[str, float], tok: float) -> dict:
    """One steady 10 s window of `rank`, 20 optimizer steps in it."""
    rec = _profile(window, False, stages, workers=workers)
    rec.update(rank=rank, steps=20, tokens_per_s={"target": tok, "drafter": tok})
    return rec


def _two_ranks() -> list[dict]:
    """Rank 0 waits in the all-reduce 7 s of 10 (its optimizer worker is busiest, but the
    all-reduce is waiting); rank 1's drafter works 8 s of 10 and spends 1 s in the all-reduce:
    rank 1 is the slowest (8 s of work against rank 0's 6 s)."""
    start = {"event": "run_start", "world_size": 2, "backend": "gloo"}
    r0 = {"target.model_forward": 4.0, "drafter.forward": 6.0, "drafter.allreduce": 7.0, "drafter.optimizer_step": 2.0}
    r1 = {"target.model_forward": 4.0, "drafter.forward": 8.0, "drafter.allreduce": 1.0, "drafter.optimizer_step": 2.0}
    return [
        {**start, "rank": 0}, {**start, "rank": 1},
        {**_profile(0, True, {"drafter.forward": 1.0}), "rank": 0},  # warm-up: dropped
        _rank_profile(0, 1, r0, {"target0": 0.4, "drafter0": 0.6, "optimizer": 0.9}, 100.0),
        _rank_profile(1, 1, r1, {"target0": 0.4, "drafter0": 0.8, "optimizer": 0.3}, 90.0),
    ]  # fmt: skip


def test_several_ranks_are_reported_one_by_one():
    """Each rank's throughput, steps/s, busy fractions, bottleneck and all-reduce share; the
    stage table over all ranks (drafter.allreduce its own stage, the mean share); the run's
    throughput the sum; the slowest rank is the one with most work per step outside the
    all-reduce, not the one whose worker is busiest with the all-reduce counted."""
    a = analyze(_two_ranks())
    assert a["world_size"] == 2 and a["backend"] == "gloo" and a["missing_ranks"] == []
    r0, r1 = a["ranks"]
    assert (r0["rank"], r0["windows"], r0["steps"], r0["steps_per_s"]) == (0, 1, 20, 2.0)
    assert (r0["tokens_per_s"], r1["tokens_per_s"], a["tokens_per_s"]) == (100.0, 90.0, 190.0)
    assert r0["busy"] == {"optimizer": 0.9, "drafter": 0.6, "target": 0.4}
    assert (r0["allreduce_share"], r1["allreduce_share"]) == (0.7, 0.1)
    assert (r0["allreduce_ms_per_step"], r1["allreduce_ms_per_step"]) == (350.0, 50.0)
    assert (r0["bottleneck"], r0["bottleneck_busy"]) == ("optimizer", 0.9)
    assert (r1["bottleneck"], r1["bottleneck_busy"]) == ("drafter", 0.8)
    assert (r0["busiest_worker"], r0["work_ms_per_step"]) == ("drafter0", 300.0)  # optimizer: 0.9 - 0.7
    assert (r1["busiest_worker"], r1["work_ms_per_step"]) == ("drafter0", 400.0)
    assert a["slowest_rank"] == 1 and a["slowest_by"] == "work_ms_per_step"
    assert a["stages"]["drafter.allreduce"]["share"] == 0.4 and a["wall_s"] == 20.0
    text = format_report(a)
    assert text.startswith("2 ranks (world size 2, gloo)")
    assert "drafter.allreduce " in text and "\nslowest rank: 1 (drafter0 400.00 ms; fastest rank 0 300.00 ms)" in text
    assert "cross-node all-reduce (drafter.allreduce): 40.0% of wall time over the ranks (rank 0 70.0%, rank 1 " \
        "10.0%), 200.00 ms per step" in text  # fmt: skip
    row1 = next(ln for ln in text.splitlines() if ln.startswith("   1 "))
    assert row1.split() == ["1", "90", "2.00", "40%", "80%", "30%", "10.0%", "400.00", "drafter", "(80%", "busy)"]


def test_ranks_without_step_counts_or_workers_and_a_missing_rank():
    """Without step counters or per-worker figures, the roles' stages and the
    optimizer_step count stand in; a rank whose records are absent is named."""
    recs = [r for r in _two_ranks() if r.get("rank") == 0 or r["event"] == "run_start"]
    for r in recs:
        r.pop("steps", None)
        r.pop("workers", None)
    recs.remove(next(r for r in recs if r["event"] == "run_start" and r["rank"] == 1))
    recs.append({**_profile(3, False, {"drafter.forward": 1.0}), "rank": 2})
    a = analyze(recs)
    r0 = a["ranks"][0]
    assert r0["steps"] == 10 and r0["busiest_worker"] == "drafter" and r0["work_ms_per_step"] == 600.0
    assert a["world_size"] == 3 and a["missing_ranks"] == [1] and [r["rank"] for r in a["ranks"]] == [0, 2]
    assert "no records of rank 1 (world size 3)" in format_report(a)


def test_single_process_log_has_no_rank_section():
    """Records without `rank`: one process, analysed as ever (no per-rank figures)."""
    a = analyze([_profile(0, False, {"drafter.forward": 5.0})])
    assert "ranks" not in a and "slowest_rank" not in a
    assert not format_report(a).startswith("2 ranks")


def _write(path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")


def test_run_folder_with_two_rank_files(tmp_path):
    """A run folder: records.jsonl (rank 0) and records.rank1.jsonl are both read, other
    files left alone; naming the two files, or the folder through the CLI, gives the same."""
    from click.testing import CliRunner

    from dflash.cli import main
    from dflash.report import read_logs

    recs = _two_ranks()
    _write(tmp_path / "records.jsonl", [r for r in recs if r["rank"] == 0])
    _write(tmp_path / "records.rank1.jsonl", [r for r in recs if r["rank"] == 1])
    (tmp_path / "config.toml").write_text("not a log", encoding="utf-8")
    expected = analyze(recs)
    assert analyze(read_logs([str(tmp_path)])) == expected
    files = [str(tmp_path / "records.jsonl"), str(tmp_path / "records.rank1.jsonl")]
    assert analyze(read_logs(files)) == expected
    out = CliRunner().invoke(main, ["report", "--json", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == json.loads(json.dumps(expected))
    out = CliRunner().invoke(main, ["report", *files])
    assert out.exit_code == 0 and "slowest rank: 1 (" in out.output
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no records\.jsonl"):
        read_logs([str(tmp_path / "empty")])


def test_records_of_two_ranks_in_one_file(tmp_path):
    """One log with both ranks' lines interleaved (e.g. concatenated) is grouped by `rank`."""
    from dflash.report import read_logs

    recs = _two_ranks()
    mixed = [recs[1], recs[0], recs[4], recs[2], recs[3]]
    _write(tmp_path / "all.jsonl", mixed)
    a = analyze(read_logs([str(tmp_path / "all.jsonl")]))
    assert a == analyze(recs)
    assert [r["rank"] for r in a["ranks"]] == [0, 1] and a["slowest_rank"] == 1
