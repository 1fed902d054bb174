"""Shared fixtures: a tiny config that runs the whole pipeline in a second or two, and one
short real `bin/dflash run` that the CLI and report tests share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

ROOT = Path(__file__).resolve().parents[1]
DFLASH = ROOT / "bin" / "dflash"
TINY = ROOT / "configs" / "tiny.toml"
sys.path.insert(0, str(ROOT / "bench"))  # the benchmarks' stand-ins (`simulated`) are tested too

# Limit for a subprocess that runs training: far above what it needs (seconds), so that only
# a hang fails, not a loaded machine.
CLI_TIMEOUT_S = 600

# Two cores: keep torch from oversubscribing them when stages run in parallel threads.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _reset_structlog():
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def tiny_overrides(out_dir: Path, **extra: object) -> list[str]:
    """Overrides that make configs/tiny.toml fast: few samples, one epoch, logs every step."""
    base = {
        "run.output_dir": f'"{out_dir}"',
        "data.num_samples": "32",
        "data.gen_len": "24",
        "train.epochs": "1",
        "train.log_every": "1",
        "profile.interval_s": "0.5",
    }
    base.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def tiny_config(tmp_path: Path):
    from dflash import load_config

    def make(**extra: object):
        return load_config(ROOT / "configs" / "tiny.toml", tiny_overrides(tmp_path, **extra))

    return make


def run_records(
    cfg: Any, into: list[dict[str, Any]] | None = None, timeout_s: float | None = None, **kwargs: Any
) -> list[dict[str, Any]]:
    """Run a Coordinator on `cfg` to its end; every record it emitted, in order.

    `into`: append the records to this list as they come, so that a test expecting the run
    to raise still sees what came before. `timeout_s`: a guard against a hang (TimeoutError),
    not a speed limit. Other keyword arguments go to the Coordinator."""
    import asyncio

    from dflash import Coordinator

    records: list[dict[str, Any]] = [] if into is None else into
    coord = Coordinator(cfg, log=False, **kwargs)
    coord.subscribe(records.append)
    asyncio.run(asyncio.wait_for(coord.run(), timeout_s))
    return records


def dflash(
    *args: str, env: dict[str, str] | None = None, input: str | None = None, timeout: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run bin/dflash from the repository root, DFLASH_PROFILE_INTERVAL cleared unless `env` sets it."""
    full_env = {k: v for k, v in os.environ.items() if k != "DFLASH_PROFILE_INTERVAL"}
    full_env.update(env or {})
    return subprocess.run(
        [str(DFLASH), *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT, input=input
    )


@dataclass(frozen=True)
class CliRun:
    out: Path  # run.output_dir: the run folder is out / "tiny"
    log: Path  # --log-file
    proc: subprocess.CompletedProcess[str]


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """One short real `bin/dflash run` of the tiny config, shared by every test that reads a
    CLI run's output: 32 random samples (no generation at set-up), batch 8, one epoch -> 4
    steps, each logged, eval at the end; a log file; the profile interval set both by the
    env var (0.25) and by the flag (0.5)."""
    out = tmp_path_factory.mktemp("cli_run")
    proc = dflash(
        "run", str(TINY),
        "--set", f'run.output_dir="{out}"', "--set", 'data.source="random"', "--set", "data.num_samples=32",
        "--set", "data.gen_len=24", "--set", "train.epochs=1", "--set", "train.log_every=1",
        "--set", "eval.max_new_tokens=16",
        "--profile-interval", "0.5", "--log-file", str(out / "log.jsonl"),
        env={"DFLASH_PROFILE_INTERVAL": "0.25"},
    )  # fmt: skip
    return CliRun(out, out / "log.jsonl", proc)


def json_lines(text: str) -> list[dict[str, Any]]:
    """Parse every line as JSON; any non-JSON line fails the test."""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"non-JSON line on stdout: {line!r}")
    return records
