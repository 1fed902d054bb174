"""The README's claims about what a run does, checked against a run: the embedding snippet runs
as written, the `setup` record's fields and the stage list are the code's, and the threads are
one per device."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import tomli_w

from dflash import Coordinator
from dflash.runtime.profiler import Stage
from tests.conftest import ROOT, TINY

README = (ROOT / "README.md").read_text(encoding="utf-8")
ENVELOPE = {"event", "level", "timestamp", "rank"}


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def _names(text: str) -> list[str]:
    return re.findall(r"`([a-z_][a-z0-9_.]*)`", text)


def test_the_embedding_snippet_runs_as_written(tmp_path: Path):
    """The README's "From your own program" code, unchanged, in a fresh interpreter (a folder
    with a configs/tiny.toml of its own, so that its run folder lands there: the repository's,
    with fewer and shorter synthetic samples and a shorter eval; the snippet's 20 steps stay)."""
    code = re.search(r"```python\n(.*?)```", _section("From your own program"), re.S)
    assert code is not None
    tiny = tomllib.loads(TINY.read_text(encoding="utf-8"))
    tiny["data"].update(num_samples=64, gen_len=16)  # 8 batches an epoch, 4 epochs: past the 20 steps
    tiny["eval"].update(num_prompts=1, max_new_tokens=8)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.toml").write_text(tomli_w.dumps(tiny), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code.group(1)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    events = out.stdout.splitlines()  # the subscriber's lines, then `dflash.run`'s own records
    assert events[0] == "run_start" and "train_step" in events and "run_end" in events
    assert (tmp_path / "runs" / "tiny" / "final" / "model.safetensors").exists()


def test_setup_record_fields_and_stages_are_the_readmes(tiny_config):
    """The `setup` fields the README lists are the record's; the stage list it links
    (docs/architecture.md) is the profiler's (`Stage.timed()`); worker threads are one per
    device (data, each target chain, each drafter replica, the optimizer)."""
    threads: set[str] = set()

    def seen(record: dict) -> None:
        if record["event"] == "train_step":
            threads.update(t.name.rsplit("_", 1)[0] for t in threading.enumerate() if t.name.startswith("dflash-"))

    cfg = tiny_config(**{"train.max_steps": 2, "train.log_every": 1, "eval.at_end": "false",
                         "pipeline.drafter_devices": '["cpu", "cpu"]'})  # fmt: skip
    records: list[dict] = []
    coord = Coordinator(cfg, log=False)
    coord.subscribe(records.append)
    coord.subscribe(seen)
    asyncio.run(coord.run())
    setup = next(r for r in records if r["event"] == "setup")
    records_text = _section("Records on stdout")
    listed = _names(records_text[records_text.index("`setup` (") : records_text.index("`train_step`")])
    assert set(listed) - {"setup"} == set(setup) - ENVELOPE
    arch = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")  # the README links the list there
    stages = arch[arch.index("The profile's stages:") :].split("\n\n", 1)[0]
    assert _names(stages) == Stage.timed()
    assert threads == {"dflash-data", "dflash-target0", "dflash-drafter0", "dflash-drafter1", "dflash-optimizer"}
