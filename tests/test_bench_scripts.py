"""The benchmark scripts themselves keep working (their figures live in BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.conftest import CLI_TIMEOUT_S, ROOT


@pytest.mark.slow
def test_gpu_check_script_dry_run_on_cpu(tmp_path: Path) -> None:
    """DRY_RUN=1 runs bench/gpu_check.sh end to end on CPU with tiny shapes: the checks run what
    they can on CPU (those that need CUDA say SKIP; pipeline_equals_serial is judged on CPU
    too), the measures run, one line each, then the JSON line — also written to $OUT — so
    that the script is sound before a GPU is at hand. What it leaves in $OUT comes back from
    the GPU machine: a few plain files, the run folders, reports and traces in runs.tar.gz."""
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    last = json.loads(lines[-1])
    assert last["bench"] == "gpu_check" and last["dry_run"] and last["ok"] and not last["partial"]
    assert {line.split()[0] for line in lines[:-1]} <= {"INFO", "PASS", "SKIP", "MEASURE"}, lines
    checks = last["checks"]
    assert list(checks) == [
        "cuda_paths", "cpu_reference_losses", "no_unnamed_syncs", "pipeline_equals_serial", "families", "families_syncs"
    ]  # fmt: skip
    judged_on_cpu = ("pipeline_equals_serial", "families")
    for name in judged_on_cpu:
        assert checks[name]["status"] == "PASS" and "bit-identical" in checks[name]["detail"], checks[name]
    assert "dflash2:" in checks["families"]["detail"] and "dspark:" in checks["families"]["detail"]
    assert all(c["status"] == "SKIP" for n, c in checks.items() if n not in judged_on_cpu)
    for name in ("cuda_paths", "cpu_reference_losses"):  # exercised on CPU, not only skipped
        assert checks[name]["detail"].startswith("(no CUDA) ran on CPU"), checks[name]
    assert "calls outside training" in checks["cuda_paths"]["detail"]  # the end-of-run eval's, apart
    measures = last["measures"]
    for name in ("matmul_peak", "flex_compile", "bench_setup", "target_forward", "drafter_step", "pipeline_vs_serial"):
        assert measures[name]["status"] == "OK", (name, measures[name])
    assert (
        measures["pipeline_vs_serial"]["pipeline"]["steady_steps"] > 0 and measures["pipeline_vs_serial"]["ratio"] > 0
    )
    assert measures["peak_memory"]["status"] == "SKIP"
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == last
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpu_check.json", "gpu_check.out", "gpu_check.stderr.log", "runs.tar.gz"
    ]  # fmt: skip
    assert all(p.is_file() and p.stat().st_size < 16 * 2**20 for p in tmp_path.iterdir())
    with tarfile.open(tmp_path / "runs.tar.gz") as tar:
        packed = {name.removeprefix("./") for name in tar.getnames()}
    for mode in ("pipeline", "serial"):
        assert {f"bench_{mode}.trace.json", f"bench_{mode}.report.txt", f"runs/bench_{mode}/records.jsonl"} <= packed


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_reports_a_crash_as_one_fail_line_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A check or measure that raises prints one FAIL line with its one-line error (the
    traceback goes to stderr), and the next one still runs; the JSON says which failed."""
    gc = _gpu_check()
    ctx = gc.Context(tmp_path, dry=False, dev="cpu", budget_s=60)

    def crash() -> str:
        raise RuntimeError("stage drafter.forward[0] failed:\n  out of memory")

    ctx.check("first", crash)
    ctx.check("second", lambda: "fine")
    ctx.measure("third", lambda: (1 / 0, ""))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FAIL first RuntimeError: stage drafter.forward[0] failed: out of memory [")
    assert out[1].startswith("PASS second fine [") and out[2].startswith("FAIL third ZeroDivisionError")
    res = ctx.result(partial=False)
    assert res["failed"] == ["first", "third"] and not res["ok"]


def test_gpu_check_probe_judges_the_training_attention_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_paths wants the drafter's training attention under autocast; the end-of-run eval
    decodes in fp32 without it, on purpose. The Probe keeps the calls made inside
    MicroStep.compute and only counts the others, so the eval is no false FAIL."""
    import torch

    import dflash.model.drafter as drafter
    import dflash.train.step as step

    gc = _gpu_check()
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)

    def probed(autocast: bool) -> Any:
        def training(rep: Any, device: Any, batch: Any, spec: Any) -> torch.Tensor:  # as step.compute
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return drafter.attend(q, k, v, mask)

        monkeypatch.setattr(step, "compute", training)
        probe = gc.Probe()
        with probe.watching():
            step.MicroStep(loss=None).compute(None, None, None)  # a training micro-batch
            drafter.attend(q, k, v, mask)  # as the eval: fp32, no autocast
            drafter.attend(q, k, v, mask)
        assert not probe.missing and step.MicroStep.compute.__name__ == "compute"  # restored
        return probe

    probe = probed(autocast=True)
    assert probe.attention == {("torch.float32", "torch.float32", "torch.float32", True)}
    assert probe.other_attention == 2 and probe.autocast_problem() is None
    run = gc.Run([], [], SimpleNamespace(targets=[]))
    bad, seen = probe.verdict(run, 0, d2h=False, evaluated=False)
    assert not [b for b in bad if "autocast" in b or "attention call" in b], bad
    assert "under autocast (+2 calls outside training)" in seen

    problem = probed(autocast=False).autocast_problem()
    assert problem is not None and problem.startswith("training attention not under autocast")
    idle = gc.Probe()
    assert idle.autocast_problem() == "no attention call in training compute (0 outside it)"


def test_gpu_ready_checks_what_travels_and_names_what_is_missing(tmp_path: Path) -> None:
    """bench/gpu_ready.sh: one line per check, READY only when every one passed. What travels
    to the GPU machine (the working tree and wheels/) is small; a check it cannot pass says
    so on a MISSING line and the script ends NOT READY."""
    script = str(ROOT / "bench" / "gpu_ready.sh")
    env = {**os.environ, "PYTHON": sys.executable}
    travel = subprocess.run(["bash", script, "travel"], capture_output=True, text=True, env=env, timeout=60)
    assert travel.returncode == 0 and travel.stdout.startswith("ok travel: "), travel.stdout + travel.stderr
    assert travel.stdout.splitlines()[-1] == "READY"
    fp = subprocess.run(["bash", script, "fingerprint"], capture_output=True, text=True, env=env, timeout=60)
    assert fp.returncode == 0 and len(fp.stdout.strip()) == 16, fp.stdout + fp.stderr
    env["PYTHON"] = str(tmp_path / "no-python")  # every check that needs python fails, and says so
    bad = subprocess.run(["bash", script, "compat"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and bad.stdout.splitlines()[-1] == "NOT READY: compat", bad.stdout + bad.stderr
    assert bad.stdout.startswith("MISSING compat: ")


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


@pytest.mark.slow
def test_allreduce_bench_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """bench/allreduce.py --quick: two gloo processes time World.all_reduce over the tiny and
    demo drafters' trainable parameter shapes (counted on the meta device); the sums come
    out right, and a gradient over --max-bytes is measured over a prefix and extrapolated.
    The script's main() runs here, its command line in sys.argv; its two worker processes
    (`python bench/allreduce.py --worker ...`, started by its own `spawn`) are forked from
    the tests' server (conftest.ForkedPopen), not new interpreters."""
    from tests import cli_child
    from tests.conftest import ForkedPopen

    script = ROOT / "bench" / "allreduce.py"
    spec = importlib.util.spec_from_file_location("allreduce", script)
    assert spec is not None and spec.loader is not None
    allreduce = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(allreduce)
    workers: list[list[str]] = []

    def forked(cmd: list[str], stdout: Any, stderr: Any, env: dict[str, str], cwd: Path) -> ForkedPopen:
        assert cmd[:3] == [sys.executable, str(script), "--worker"], cmd
        workers.append(cmd)
        return ForkedPopen(cmd, cmd[1:], env, cwd, stdout, stderr, child=cli_child.run_script)

    popen = SimpleNamespace(Popen=forked, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(allreduce, "subprocess", popen)
    monkeypatch.setattr(sys, "argv", [str(script), "--quick", "--max-bytes", "16000000"])
    monkeypatch.chdir(tmp_path)
    allreduce.main()
    out = capsys.readouterr().out
    assert len(workers) == 2
    last = json.loads(out.strip().splitlines()[-1])
    assert last["bench"] == "allreduce" and last["procs"] == 2 and last["runs"] == []
    tiny, demo = last["allreduce"]
    assert (tiny["case"], tiny["params"], demo["case"], demo["params"]) == ("tiny", 41_248, "demo", 3_873_152)
    assert tiny["ok"] and demo["ok"] and tiny["ms"] > 0 and not tiny["extrapolated"]
    assert demo["extrapolated"] and 2 * demo["measured_mib"] * 2**20 <= 16_000_000  # two fp32 copies
    assert demo["ms"] > demo["measured_ms"] > 0


@pytest.mark.slow
def test_ablation_script_trains_variants_and_writes_a_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """bench/ablation.py on the tiny config: two variants, a few steps each, one markdown row
    per variant and the JSON line. Each variant's run is its own (the wsd schedule ends at
    another loss than the cosine one) and its end-of-run eval measured a drafter that
    learned something (τ above 1; an untrained one's is ≈ 1.00), losslessly. The script's
    main() runs here, its command line in sys.argv; each variant's `bin/dflash run` is a
    real process, forked from the tests' server (`conftest.dflash`), not a new interpreter."""
    from tests.conftest import dflash

    spec = importlib.util.spec_from_file_location("ablation", ROOT / "bench" / "ablation.py")
    assert spec is not None and spec.loader is not None
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    calls: list[tuple[str, ...]] = []

    def forked(*args: str) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        return dflash(*args)

    monkeypatch.setattr(ablation, "_dflash", forked)
    monkeypatch.setattr(sys, "argv", [
        "ablation.py", "--config", str(ROOT / "configs" / "tiny.toml"), "--variants", "baseline,wsd",
        "--steps", "4", "--mtbench", "0",
        "--set", f"run.output_dir='{tmp_path}'", "--set", "data.num_samples=32", "--set", "eval.max_new_tokens=8",
    ])  # fmt: skip
    ablation.main()
    out = capsys.readouterr().out
    assert [c[0] for c in calls] == ["run", "run"]  # one run per variant, no eval (--mtbench 0)
    lines = out.strip().splitlines()
    result = json.loads(lines[-1])
    rows = result["rows"]
    assert [r["variant"] for r in rows] == ["baseline", "wsd"]
    assert all(r["steps"] == 4 and r["heldout_tau"] > 1.0 and r["lossless"] for r in rows), rows
    assert rows[0]["final_loss"] != rows[1]["final_loss"], rows  # the variant's override reached its run
    assert lines[0].startswith("| variant |") and sum(line.startswith("| baseline") for line in lines) == 1
    assert f"{rows[0]['heldout_tau']:.3f}" in next(line for line in lines if line.startswith("| baseline"))


def test_draft_vocab_step_bench_runs_a_step_at_each_size() -> None:
    """bench/draft_vocab_step.py's one setting, at the tiny shape: a step with the whole
    vocabulary and with a draft vocabulary, the labels it holds counted."""
    spec = importlib.util.spec_from_file_location("draft_vocab_step", ROOT / "bench" / "draft_vocab_step.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    whole, pruned = bench.one("tiny", 0, 1, "cpu"), bench.one("tiny", 64, 1, "cpu")
    assert whole["head_rows"] == 512 and pruned["head_rows"] == 64 and pruned["labels_covered"] < 1.0
    assert whole["step_s"] > 0 and pruned["supervised_slots"] == whole["supervised_slots"]


def test_long_context_bench_runs_a_step_on_each_path() -> None:
    """bench/long_context.py's one point at a short row: both paths, the same loss; the sp2 point
    under two ranks: the same loss again (`test_long_context_bench_sp2_point`)."""
    spec = importlib.util.spec_from_file_location("long_context", ROOT / "bench" / "long_context.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    grouped, dense = bench.one(1024, "grouped"), bench.one(1024, "dense")
    decoded = bench.decode(512)  # `--decode`: speculative decoding after a long prompt, checked lossless
    assert decoded["lossless"] and decoded["prompt_tokens"] == 512
    assert grouped["anchors"] == 16 and abs(grouped["loss"] - dense["loss"]) <= 1e-5 * abs(dense["loss"])


@pytest.mark.slow
def test_long_context_bench_end_to_end(tmp_path) -> None:
    """bench/long_context.py --end-to-end at 1,024 tokens: regen answers two long conversations
    and keeps their features; a run at sequence parallelism 2 trains on both whole rows from the
    feature store."""
    spec = importlib.util.spec_from_file_location("long_context", ROOT / "bench" / "long_context.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    got = bench.end_to_end(1024, rows=2, steps=2, out=tmp_path)
    stored, live = got["run"], got["run_target"]
    assert got["replies"] == 2 and stored["feature_store_hits"] == 2 and live["feature_store_hits"] == 0, got
    assert stored["truncated"] == 0 and 900 < stored["row_tokens"] <= 1024, got
    # the target's forward gives the features regen kept: the same losses
    assert len(stored["losses"]) == 2 and live["losses"] == pytest.approx(stored["losses"], rel=1e-3), got


@pytest.mark.slow
def test_long_context_bench_sp2_point(tmp_path) -> None:
    """bench/long_context.py's sp2 point: two torchrun ranks share a 1,024-token row; the loss
    is the one-process grouped step's."""
    cmd = [sys.executable, str(ROOT / "bench" / "long_context.py"), "--rows", "1024", "--paths", "sp2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (two,) = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    spec = importlib.util.spec_from_file_location("long_context", ROOT / "bench" / "long_context.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    one = bench.one(1024, "grouped")
    assert two["path"] == "sp2" and abs(one["loss"] - two["loss"]) <= 1e-5 * abs(one["loss"])
