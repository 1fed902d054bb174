"""Stopping a run in each of its phases, and a drafter refused for another target.

- Ctrl-C / SIGTERM after the last step stops the end-of-run eval at its next decoding step;
  the export stays, `run_end` says `eval_stopped`.
- A signal during set-up (models loading in the worker thread), or before the event loop
  exists, ends the run with exit 0 and `run_end` (reason "stopped", `stopped_during` "setup"),
  and leaves nothing half-written in the run folder.
- A drafter or checkpoint made for another target is refused in one line that names both
  shapes and the config keys that differ, before the target loads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash.config import TinyTargetConfig, load_config
from dflash.errors import CheckpointError
from dflash.eval.decode import EvalStopped
from dflash.eval.tally import DecodeSettings, evaluate
from dflash.model.drafter import DFlashDrafter, FrozenHead
from dflash.model.export import load_drafter
from dflash.model.target import TargetShape, build_tiny, load_target
from dflash.train.build import drafter_spec
from tests.conftest import CLI_TIMEOUT_S, DFLASH, ROOT, TINY, json_lines, records_until, run_records, tiny_overrides


def _args(out: Path, **settings: object) -> list[str]:
    return [str(DFLASH), "run", str(TINY), *(a for kv in tiny_overrides(out, **settings) for a in ("--set", kv))]


def _pipes() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_PROFILE_INTERVAL"}
    return {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "env": env}


# -- the end-of-run eval ------------------------------------------------------------------


class _Asked:
    """A `should_stop` that counts its calls and says True from call `at` on."""

    def __init__(self, at: int | None = None) -> None:
        self.calls, self.at = 0, at

    def __call__(self) -> bool:
        self.calls += 1
        return self.at is not None and self.calls >= self.at


def _models() -> tuple[Any, DFlashDrafter, FrozenHead, list[torch.Tensor]]:
    from dflash.data.synthetic import draw_prompts

    cfg = load_config(TINY)
    target = load_target(cfg.target, torch.device("cpu"), 1)
    drafter = DFlashDrafter(drafter_spec(cfg, target, target.vocab_size - 1))
    drafter.init_weights(torch.Generator().manual_seed(0))
    prompts = draw_prompts(cfg.data, target.vocab_size, 4, 7, target.vocab_size - 1)
    return target, drafter, FrozenHead(target.embed_weight, target.lm_head_weight), prompts


@pytest.mark.parametrize("batch_size", [1, 4])
def test_the_eval_asks_should_stop_once_per_decoding_step_and_ends_at_the_first_yes(batch_size: int) -> None:
    """Asked at every step of both decodings (speculative and plain), one prompt at a time or
    batched: a never-true check changes nothing; one that turns true halfway ends the eval
    with EvalStopped at that very call."""
    target, drafter, head, prompts = _models()
    plain = evaluate(target, drafter, head, prompts, DecodeSettings(24, batch_size=batch_size))
    never = _Asked()
    asked = evaluate(target, drafter, head, prompts, DecodeSettings(24, batch_size=batch_size, should_stop=never))
    assert asked["accept_hist"] == plain["accept_hist"] and asked["lossless"] is True
    assert never.calls > 24  # more than one generation's tokens: asked inside the decoding loops
    halfway = _Asked(at=never.calls // 2)
    with pytest.raises(EvalStopped):
        evaluate(target, drafter, head, prompts, DecodeSettings(24, batch_size=batch_size, should_stop=halfway))
    assert halfway.calls == never.calls // 2


@pytest.mark.slow
def test_a_signal_after_the_last_step_stops_the_end_of_run_eval_and_keeps_the_export(tmp_path: Path, popen) -> None:
    """`bin/dflash run` with an end-of-run eval of 64 prompts (over a minute on a tiny run):
    SIGTERM once the `export` record is out. The eval ends at its next decoding step: exit 0,
    no `eval` record, `run_end` with the reason training ended by (max_steps) and
    `eval_stopped`, the stderr line says the eval is stopped, and the export loads."""
    settings = {"train.max_steps": 3, "eval.num_prompts": 64, "eval.max_new_tokens": 48}
    proc = popen(_args(tmp_path, **settings), **_pipes())
    assert proc.stdout is not None
    before = records_until(proc.stdout, lambda r: r["event"] == "export", "the export")
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    took = time.perf_counter() - t0
    print(f"SIGTERM -> exit: {took:.2f}s")
    assert proc.returncode == 0, err
    assert "stopping the end-of-run eval" in err and "Traceback" not in err, err
    records = before + json_lines(rest)
    assert "eval" not in {r["event"] for r in records}
    end = records[-1]
    assert end["event"] == "run_end" and end["reason"] == "max_steps" and end["steps"] == 3, end
    assert end["eval_stopped"] is True and end["stopped_during"] == "finishing" and end["eval_tau"] is None, end
    assert end["export_dir"] == before[-1]["path"]
    assert load_drafter(end["export_dir"]).spec.block_size == 8


def test_a_stop_ends_a_mid_run_eval_at_its_next_decoding_step(tiny_config, monkeypatch) -> None:
    """A stop asked while an `eval.every_steps` eval decodes (64 prompts: over a minute if it
    ran on; here asked as its third decoding step checks for one) ends that eval at its next
    decoding step, with a warning record, and the run stops after that step as after any
    other: reason "stopped", no `eval` record."""
    import asyncio

    from dflash import Coordinator
    from dflash.eval import decode

    cfg = tiny_config(**{"eval.every_steps": 2, "eval.num_prompts": 64, "eval.max_new_tokens": 48,
                         "eval.at_end": "false", "data.num_samples": 256})  # fmt: skip
    coord = Coordinator(cfg, log=False)
    records: list[dict[str, Any]] = []
    check = decode._check
    checks: list[int] = []  # the eval's decoding steps, each asking whether to stop

    def stepped(should_stop: Any) -> None:  # on the eval's thread
        checks.append(len(checks) + 1)
        if len(checks) == 3:  # stopped while it decodes
            coord.stop()
        check(should_stop)

    monkeypatch.setattr(decode, "_check", stepped)
    coord.subscribe(records.append)
    asyncio.run(asyncio.wait_for(coord.run(), 120))  # a hang guard only: the run takes seconds
    assert checks == [1, 2, 3], checks  # the eval ended at the step that saw the stop, none after
    assert "eval" not in {r["event"] for r in records}
    assert len([r for r in records if r["event"] == "warning" and "eval at step 2 stopped" in r["message"]]) == 1
    end = records[-1]
    assert end["event"] == "run_end" and end["reason"] == "stopped" and end["steps"] == 2, end


# -- set-up ---------------------------------------------------------------------------------


def _only_the_run_log(run_dir: Path) -> None:
    """Nothing half-written: no checkpoint, no export, no temporary folder; the run's log."""
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.toml", "records.jsonl"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_set_up_ends_the_run_with_its_run_end(tmp_path: Path, popen, sig: signal.Signals) -> None:
    """The signal right after `run_start`, while set-up loads the target and synthesizes
    samples in its worker thread: set-up ends at its next phase boundary, exit 0, no `setup`
    record, `run_end` reason "stopped" during "setup"."""
    proc = popen(_args(tmp_path, **{"data.num_samples": 64, "data.gen_len": 48}), **_pipes())
    assert proc.stdout is not None
    before = records_until(proc.stdout, lambda r: r["event"] == "run_start", "run_start")
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, err
    assert "stopping set-up" in err and "Traceback" not in err, err
    records = before + json_lines(rest)
    assert [r["event"] for r in records] == ["run_start", "run_end"], [r["event"] for r in records]
    end = records[-1]
    assert end["reason"] == "stopped" and end["stopped_during"] == "setup" and end["steps"] == 0, end
    _only_the_run_log(tmp_path / "tiny")


def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/PID/status")
def test_a_signal_before_the_event_loop_ends_the_run_with_its_run_end(tmp_path: Path, popen) -> None:
    """SIGTERM as soon as the process takes it (its handler is in /proc's SigCgt), long before
    torch is imported and the event loop runs: the run starts stopped, exit 0, `run_start`
    then `run_end` (reason "stopped" during "setup"), no set-up done. A new interpreter: one
    forked from the tests' server has torch loaded already."""
    proc = popen(_args(tmp_path), fresh=True, **_pipes())
    deadline = time.monotonic() + 60
    while not _catches_sigterm(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, "the process never took SIGTERM"
        time.sleep(0.002)
    assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text(), "torch loaded: the signal came too late"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, err
    records = json_lines(out)
    assert [r["event"] for r in records] == ["run_start", "run_end"], err
    assert records[-1]["reason"] == "stopped" and records[-1]["stopped_during"] == "setup", records[-1]
    _only_the_run_log(tmp_path / "tiny")


_SLOW_SETUP = """
import sys, threading
import dflash.train.build as build
build.load_target = lambda *a, **k: threading.Event().wait()  # a target that never finishes loading
from dflash.cli import entry
sys.argv = ["dflash", *sys.argv[1:]]
entry()
"""


@pytest.mark.slow
def test_a_second_signal_aborts_even_while_a_worker_thread_is_busy(tmp_path: Path, popen) -> None:
    """Two SIGINTs while set-up loads a target in its worker thread, a load that never ends:
    the first asks set-up to stop at its next boundary, the second aborts (exit 130), the
    thread still busy, instead of waiting for it."""
    import sys

    proc = popen([sys.executable, "-c", _SLOW_SETUP, *_args(tmp_path)[1:]], **_pipes())
    assert proc.stdout is not None
    records_until(proc.stdout, lambda r: r["event"] == "run_start", "run_start")
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    for line in proc.stderr:  # the first is taken (two at once may arrive as one)
        if "stopping set-up" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=CLI_TIMEOUT_S)  # a hang guard: a wait for the load never ends
    assert proc.returncode == 130, err
    assert "aborted" in err, err


@pytest.fixture
def own_signals():
    """The test process's signal handlers, put back afterwards (and no signal left held for
    a later run in this process)."""
    from dflash.pipeline import runner

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    runner._held = None
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_held_signal_starts_the_run_stopped_and_a_second_aborts(tiny_config, own_signals) -> None:
    """`hold_signals` (what the CLI calls first): one signal before `run` makes the run end at
    once with its records; a second one before the loop runs aborts (KeyboardInterrupt)."""
    from dflash.pipeline import runner
    from dflash.pipeline.runner import hold_signals, run

    # raise_signal: delivered to this (the main) thread, its Python handler run before the call returns
    hold_signals()
    signal.raise_signal(signal.SIGTERM)
    assert runner._held is not None and runner._held.hits == 1
    summary = run(tiny_config())
    assert summary["reason"] == "stopped" and summary["stopped_during"] == "setup" and summary["steps"] == 0
    hold_signals()
    signal.raise_signal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


# -- a drafter for another target ---------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run of 2 steps: its folder, with `final/` and `checkpoints/step_000002/`."""
    out = tmp_path_factory.mktemp("trained")
    cfg = load_config(TINY, tiny_overrides(out, **{"train.max_steps": 2, "eval.at_end": "false",
                                                   "checkpoint.every_steps": 2}))  # fmt: skip
    run_records(cfg)
    return out / "tiny"


def _no_target_load(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the target was loaded before the drafter was refused")

    for module in modules:
        monkeypatch.setattr(f"{module}.load_target", refuse)


@pytest.mark.parametrize("folder", ["final", "checkpoints/step_000002"])
def test_eval_refuses_a_drafter_for_another_target_in_one_line_before_the_target_loads(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    """`dflash eval --drafter` (an export in its run folder, or a checkpoint) with a config
    whose target is wider: one line naming both shapes and the key that differs."""
    from dflash.eval.command import run_eval

    _no_target_load(monkeypatch, "dflash.eval.command")
    cfg = load_config(TINY, tiny_overrides(tmp_path, **{"target.tiny.hidden_size": 96}))
    with pytest.raises(CheckpointError) as err:
        run_eval(cfg, trained / folder)
    msg = str(err.value)
    assert "\n" not in msg and "size mismatch" not in msg, msg
    assert "does not fit this target: hidden size 64 vs target 96" in msg, msg
    assert "drafter made for hidden 64, vocab 512, 4 layers" in msg and "this target: hidden 96" in msg, msg
    assert msg.endswith("config keys that differ from the drafter's run: target.tiny.hidden_size 64 -> 96"), msg


@pytest.mark.slow
def test_the_eval_command_prints_the_refusal_as_one_line(trained: Path) -> None:
    """The CLI: exit 1, one `dflash: error:` line naming the layer count that differs."""
    from tests.conftest import dflash

    proc = dflash("eval", str(TINY), "--drafter", str(trained / "final"), "--set", "target.tiny.num_layers=2")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("dflash: error: drafter ") and "trained on a 4-layer target, this one has 2" in lines[0]
    assert "target.tiny.num_layers 4 -> 2" in lines[0], lines[0]


def test_resume_refuses_a_checkpoint_for_another_target_before_any_model_loads(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--resume with a target of another vocabulary: refused at once (no model loaded) in one
    line naming both shapes and the key."""
    from dflash.train.build import build_training

    _no_target_load(monkeypatch, "dflash.train.build", "dflash.model.target")
    cfg = load_config(TINY, tiny_overrides(tmp_path, **{"target.tiny.vocab_size": 256}))
    with pytest.raises(CheckpointError) as err:
        build_training(cfg, trained / "checkpoints" / "step_000002")
    msg = str(err.value)
    assert "\n" not in msg and "its drafter does not fit this run: made for another target" in msg, msg
    assert "checkpoint made for hidden 64, vocab 512" in msg and "this run's target: hidden 64, vocab 256" in msg, msg
    assert msg.endswith("config keys that differ: target.tiny.vocab_size 512 -> 256"), msg


def test_restore_refuses_another_shape_in_one_line(trained: Path) -> None:
    """Same config, other target files (what `check_resume_config` cannot see): `restore`
    names the fields and both shapes before loading any weight; without the config, the
    weights' own check names the tensors, still in one line."""
    from dflash.train.checkpoint import load_checkpoint, restore

    loaded = load_checkpoint(trained / "checkpoints" / "step_000002")
    cfg = load_config(TINY, tiny_overrides(trained.parent, **{"train.max_steps": 2, "eval.at_end": "false",
                                                              "checkpoint.every_steps": 2}))  # fmt: skip
    narrower = cfg.target.model_copy(update={"tiny": TinyTargetConfig(hidden_size=32)})
    other = load_target(narrower, torch.device("cpu"), 1)
    replica = SimpleNamespace(model=DFlashDrafter(drafter_spec(cfg, other, 511)), device=torch.device("cpu"))
    with pytest.raises(CheckpointError) as err:
        restore(loaded, [replica], cfg)
    msg = str(err.value)
    assert "\n" not in msg and "hidden_size 64 vs 32" in msg and "this run's target: hidden 32" in msg, msg
    assert msg.endswith("no config key differs, so the target's own files differ from those it was trained with"), msg
    with pytest.raises(CheckpointError, match=r"weights do not fit this config: .*\(64, 64\) vs \(32, 32\) here"):
        restore(loaded, [replica])


def test_a_hugging_face_targets_shape_is_read_from_its_config_json(tmp_path: Path) -> None:
    """`TargetShape.from_config` (no weights loaded) gives what the loaded target has."""
    build_tiny(TinyTargetConfig(hidden_size=48, num_layers=3)).save_pretrained(tmp_path)
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["target.kind='hf'", f"target.path='{tmp_path}'"])
    loaded = load_target(cfg.target, torch.device("cpu"), 1)
    assert TargetShape.from_config(cfg.target) == TargetShape.of(loaded)
