"""The `bin/dflash` command, as real subprocesses: JSON on stdout, one-line errors on stderr."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest

from dflash.config import load_config, parse_config
from tests.conftest import (
    CLI_TIMEOUT_S,
    DFLASH,
    ROOT,
    TINY,
    CliRun,
    dflash,
    json_lines,
    lines_until,
    popen_cli,
    records_until,
    run_records,
    tiny_overrides,
)


def assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """Exit 2, nothing on stdout, exactly one 'dflash: error:' line on stderr; returns it."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dflash: error: "), lines[0]
    assert proc.stdout == ""
    return lines[0]


# -- config show ---------------------------------------------------------------------------


def test_config_show_prints_resolved_toml_with_overrides() -> None:
    """`config show FILE --set k=v` prints parseable TOML with the override applied."""
    proc = dflash("config", "show", "configs/tiny.toml", "--set", "drafter.num_layers=2")
    assert proc.returncode == 0, proc.stderr
    data = tomllib.loads(proc.stdout)
    assert data["drafter"]["num_layers"] == 2
    assert data["run"]["name"] == "tiny"  # from the file
    assert data["optimizer"]["grad_clip"] == 1.0  # a default, filled in
    assert parse_config(data) == load_config(TINY, ["drafter.num_layers=2"])


def test_config_show_prints_every_key_with_its_default_and_meaning(tmp_path: Path) -> None:
    """`config show` lists every key of the schema under a comment with its meaning and default
    (unset keys commented out), and what it prints is a config file that loads back the same."""
    from dflash.config import Config, DrafterConfig

    proc = dflash("config", "show", str(TINY), "--set", "drafter.num_layers=3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    at = lines.index("num_layers = 3")
    assert lines[at - 1] == f"# {DrafterConfig.model_fields['num_layers'].description} (default: 1)"
    assert "# gamma =" in lines and "# max_steps =" in lines  # unset: commented out
    for section in Config.model_fields:
        assert f"[{section}]" in lines
    shown = tmp_path / "shown.toml"
    shown.write_text(proc.stdout, encoding="utf-8")
    assert load_config(shown) == load_config(TINY, ["drafter.num_layers=3"])


# -- misuse: one line on stderr, exit 2 ----------------------------------------------------


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("missing_file", "missing.toml"),
        ("run_missing_file", "missing.toml"),
        ("unknown_set_key", "drafter.nope"),
        ("bad_value", "drafter.num_layers"),
        ("invalid_toml", "bad.toml"),
        ("unknown_key_in_file", "drafter.bogus"),
    ],
)
def test_config_misuse_is_a_one_line_error(tmp_path: Path, case: str, expect: str) -> None:
    """Config mistakes exit 2 with one 'dflash: error:' line naming the culprit, no traceback."""
    args = {
        "missing_file": ["config", "show", str(tmp_path / "missing.toml")],
        "run_missing_file": ["run", str(tmp_path / "missing.toml")],
        "unknown_set_key": ["config", "show", str(TINY), "--set", "drafter.nope=1"],
        "bad_value": ["config", "show", str(TINY), "--set", "drafter.num_layers=0"],
        "invalid_toml": ["config", "show", _write(tmp_path, "bad.toml", "[drafter\nnum_layers = 1\n")],
        "unknown_key_in_file": [
            "config", "show", _write(tmp_path, "unk.toml", "[drafter]\nbogus = 1\n"),
        ],
    }[case]  # fmt: skip
    line = assert_one_line_error(dflash(*args, fresh=True))  # a new interpreter: nothing printed on import either
    assert expect in line


def test_a_config_error_is_reported_before_torch_loads(tmp_path: Path) -> None:
    """A mistyped path or key is answered at once: the error line (its rank prefix included)
    needs no torch, which takes seconds to import."""
    code = (
        "import sys\n"
        "from dflash.cli import entry\n"
        f"sys.argv = ['dflash', 'run', {str(tmp_path / 'missing.toml')!r}]\n"
        "try:\n    entry()\n"
        "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert "missing.toml" in proc.stderr


def test_negative_profile_interval_is_a_one_line_error(tmp_path: Path) -> None:
    """`run --profile-interval -1` exits 2 with one error line naming the flag; nothing runs."""
    proc = dflash("run", str(TINY), "--set", f"run.output_dir={tmp_path}", "--profile-interval", "-1")
    line = assert_one_line_error(proc)
    assert "--profile-interval" in line
    assert not (tmp_path / "tiny").exists()


def test_non_numeric_profile_env_is_a_one_line_error(tmp_path: Path) -> None:
    """`DFLASH_PROFILE_INTERVAL=abc dflash run` exits 2 with one error line naming the variable."""
    proc = dflash("run", str(TINY), "--set", f"run.output_dir={tmp_path}", env={"DFLASH_PROFILE_INTERVAL": "abc"})
    line = assert_one_line_error(proc)
    assert "DFLASH_PROFILE_INTERVAL" in line
    assert "abc" in line
    assert not (tmp_path / "tiny").exists()


# -- runs: one real training run (the session's shared `cli_run`); the others stop after run_start --


@pytest.mark.slow
def test_short_run_writes_json_records_and_artifacts(cli_run: CliRun) -> None:
    """A short run exits 0, stdout is JSON lines only (with the key events), the log file
    holds the same records, and the run folder has config.toml and the exported drafter."""
    out, proc = cli_run.out, cli_run.proc
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    records = json_lines(proc.stdout)
    events = [r["event"] for r in records]
    for event in ("run_start", "train_step", "profile", "eval", "run_end"):
        assert event in events, events
    assert events[0] == "run_start"
    assert events[-1] == "run_end"
    steps = [r["step"] for r in records if r["event"] == "train_step"]
    assert steps == list(range(1, len(steps) + 1))  # log_every=1: every step is recorded
    assert records[-1]["steps"] == len(steps) == 4

    log_lines = cli_run.log.read_text(encoding="utf-8").splitlines()
    assert len(log_lines) == len(proc.stdout.splitlines())
    assert json_lines("\n".join(log_lines)) == records

    run_dir = out / "tiny"
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "final" / "model.safetensors").is_file()
    saved = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    assert saved["data"]["num_samples"] == 32
    assert parse_config(saved) == parse_config(records[0]["config"])  # the resolved config


@pytest.mark.slow
def test_export_turns_a_checkpoint_into_the_export_and_eval_reads_either(cli_run: CliRun, tmp_path: Path) -> None:
    """`dflash export RUN_OR_CHECKPOINT OUT` writes the export format (equal to the run's own
    final export, both bf16); `dflash eval --drafter` takes a checkpoint folder as well."""
    import torch
    from safetensors.torch import load_file

    run_dir = cli_run.out / "tiny"
    ckpt = sorted((run_dir / "checkpoints").iterdir())[-1]
    proc = dflash("export", str(run_dir), str(tmp_path / "exp"))  # a run folder: its latest checkpoint
    assert proc.returncode == 0, proc.stderr
    assert json_lines(proc.stdout)[0]["checkpoint"] == str(ckpt)
    a = load_file(str(tmp_path / "exp" / "model.safetensors"))
    b = load_file(str(run_dir / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "exp" / "config.json").read_text()) == json.loads(
        (run_dir / "final" / "config.json").read_text()
    )
    bad = dflash("export", str(tmp_path), str(tmp_path / "x"))
    assert bad.returncode != 0 and "not a dflash checkpoint folder" in bad.stderr
    # never over a folder that is not an export: the run (and its checkpoints) stay
    kept = dflash("export", str(run_dir), str(run_dir))
    assert kept.returncode != 0 and "is not an exported drafter" in kept.stderr, kept.stderr
    assert ckpt.is_dir() and (run_dir / "config.toml").is_file()
    again = dflash("export", str(ckpt), str(tmp_path / "exp"))  # an earlier export is replaced
    assert again.returncode == 0, again.stderr
    ev = dflash(
        "eval", str(TINY), "--drafter", str(ckpt), "--set", f'run.output_dir="{cli_run.out}"',
        "--set", 'data.source="random"', "--prompts", "1", "--max-new-tokens", "8",
    )  # fmt: skip
    assert ev.returncode == 0, ev.stderr
    assert json_lines(ev.stdout)[-1]["lossless"] is True


@pytest.mark.slow
def test_profile_flag_wins_over_env(cli_run: CliRun) -> None:
    """With DFLASH_PROFILE_INTERVAL=0.25 and --profile-interval 0.5, the flag (0.5) is used."""
    proc = cli_run.proc
    assert proc.returncode == 0, proc.stderr
    start = json_lines(proc.stdout)[0]
    assert start["event"] == "run_start"
    assert start["config"]["profile"]["interval_s"] == 0.5


def first_record(*args: str, env: dict[str, str], timeout: float = CLI_TIMEOUT_S) -> dict[str, Any]:
    """Start `bin/dflash run ...`, read its first stdout record, then kill the process.

    The run_start record carries the resolved config and comes before the (slow) set-up,
    so this checks how a run resolves its config without paying for a training run."""
    full_env = {k: v for k, v in os.environ.items() if k != "DFLASH_PROFILE_INTERVAL"} | env
    proc = popen_cli([str(DFLASH), "run", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=full_env)
    watchdog = threading.Timer(timeout, proc.kill)  # a silent hang ends as an empty line
    watchdog.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    assert line, "no record on stdout"
    return json.loads(line)


@pytest.mark.slow
def test_profile_env_var_is_honoured(tmp_path: Path) -> None:
    """DFLASH_PROFILE_INTERVAL=0.25 (no flag) overrides the config file's profile.interval_s."""
    start = first_record(str(TINY), "--set", f"run.output_dir={tmp_path}", env={"DFLASH_PROFILE_INTERVAL": "0.25"})
    assert start["event"] == "run_start"
    assert start["config"]["profile"]["interval_s"] == 0.25
    assert load_config(TINY).profile.interval_s != 0.25  # so the env var, not the file, set it


@pytest.mark.slow
def test_config_file_interval_is_used_without_flag_or_env(tmp_path: Path) -> None:
    """With neither the flag nor the env var, profile.interval_s comes from the config file."""
    start = first_record(str(TINY), "--set", f"run.output_dir={tmp_path}", env={})
    assert start["event"] == "run_start"
    assert start["config"]["profile"]["interval_s"] == load_config(TINY).profile.interval_s


# -- signals: the CLI layer of stopping (in-process: test_pipeline.py; torchrun: test_distributed.py) --


@pytest.mark.slow
def test_sigterm_stops_cleanly_a_second_aborts_and_resume_ends_like_an_uninterrupted_run(
    tiny_config, tmp_path: Path, popen
) -> None:
    """A real `bin/dflash run` and SIGTERM, three runs over one run folder:
    1. SIGTERM after step 4: the run stops after the step in flight: exit 0, "stopping" on
       stderr and no traceback, stdout JSON lines only, ending in run_end (reason "stopped"),
       and a checkpoint of the run_end's last step.
    2. `--resume auto`, then SIGTERM during a clean stop (a slow eval after each step keeps
       it busy): the second signal aborts: exit 130, one last line "dflash: aborted", no
       run_end; the checkpoints already written stay complete (one past the first run's).
    3. `--resume auto` to the end: the weights equal a run never interrupted."""
    from safetensors.torch import load_file

    from dflash.train.checkpoint import latest_checkpoint, load_checkpoint

    settings = {"data.num_samples": 48, "train.epochs": 40, "train.max_steps": 24, "eval.at_end": "false",
                "checkpoint.keep_last": 20}  # fmt: skip
    run_records(tiny_config(**settings, **{"run.output_dir": f'"{tmp_path / "ref"}"'}))
    out = tmp_path / "cli"
    args = [str(DFLASH), "run", str(TINY), *(a for kv in tiny_overrides(out, **settings) for a in ("--set", kv))]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}

    proc = popen(args, **pipes)
    assert proc.stdout is not None
    before = records_until(proc.stdout, lambda r: r["event"] == "train_step" and r["step"] >= 4, "step 4")
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, err
    assert "stopping" in err and "Traceback" not in err, err
    records = before + json_lines(rest)
    end = records[-1]
    assert end["event"] == "run_end" and end["reason"] == "stopped" and 4 <= end["steps"] < 24, end
    stopped = latest_checkpoint(out / "tiny")
    assert stopped is not None and load_checkpoint(stopped).step == end["steps"]

    slow_stop = ["--set", "eval.every_steps=1", "--set", "checkpoint.every_steps=2"]
    proc = popen([*args, *slow_stop, "--resume", "auto"], **pipes)
    assert proc.stdout is not None and proc.stderr is not None
    records = records_until(proc.stdout, lambda r: r["event"] == "checkpoint", "a checkpoint")
    proc.send_signal(signal.SIGTERM)
    lines_until(proc.stderr, "stopping")  # the first signal is taken: the second is another
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 130, err
    assert [ln for ln in err.splitlines() if ln.strip()][-1] == "dflash: aborted" and "Traceback" not in err, err
    assert "run_end" not in {r["event"] for r in records + json_lines(rest)}
    latest = latest_checkpoint(out / "tiny")
    assert latest is not None and load_checkpoint(latest).step > end["steps"]

    done = dflash(*args[1:], "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert json_lines(done.stdout)[-1]["steps"] == 24
    ref = load_file(tmp_path / "ref" / "tiny" / "checkpoints" / "step_000024" / "drafter.safetensors")
    got = load_file(out / "tiny" / "checkpoints" / "step_000024" / "drafter.safetensors")
    assert ref.keys() == got.keys() and all(bool((ref[k] == got[k]).all()) for k in ref)
