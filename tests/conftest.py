"""Shared fixtures: a tiny config that runs the whole pipeline in a second or two."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

ROOT = Path(__file__).resolve().parents[1]

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


def run_records(cfg: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Run a Coordinator on `cfg` to its end; every record it emitted, in order."""
    import asyncio

    from dflash import Coordinator

    records: list[dict[str, Any]] = []
    coord = Coordinator(cfg, log=False, **kwargs)
    coord.subscribe(records.append)
    asyncio.run(coord.run())
    return records


def json_lines(text: str) -> list[dict[str, Any]]:
    """Parse every line as JSON; any non-JSON line fails the test."""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"non-JSON line on stdout: {line!r}")
    return records
