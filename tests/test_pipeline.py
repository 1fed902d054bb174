"""The coordinator end to end on CPU: learning, replicas, failures, embedding, signals."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash import Coordinator, StageError
from dflash.profile import Stage
from tests.conftest import ROOT


def _run(cfg, records: list | None = None) -> Coordinator:
    coord = Coordinator(cfg, log=False)
    if records is not None:
        coord.subscribe(records.append)
    asyncio.run(coord.run())
    return coord


def test_loss_goes_down_and_records_are_complete(tiny_config):
    """A short tiny run lowers the loss, and emits run_start, train_step, profile, run_end."""
    records: list[dict] = []
    cfg = tiny_config(**{"data.num_samples": 128, "train.epochs": 2, "train.lr": 2e-2})
    coord = _run(cfg, records)
    events = [r["event"] for r in records]
    assert events[0] == "run_start" and events[-1] == "run_end"
    assert "profile" in events
    steps = [r for r in records if r["event"] == "train_step"]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert len(steps) == coord.steps == 32
    first = sum(s["loss"] for s in steps[:4]) / 4
    last = sum(s["loss"] for s in steps[-4:]) / 4
    assert last < first - 0.05, (first, last)
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "acc", "tau_sim"):
        assert key in steps[0]
    profiles = [r for r in records if r["event"] == "profile"]
    assert profiles[-1]["final"] and all("hidden_states" in p["queues"] for p in profiles)
    for stage in (Stage.TARGET_FORWARD, Stage.TARGET_PACK, Stage.DRAFTER_FORWARD, Stage.DRAFTER_BACKWARD):
        assert sum(p["stages"].get(stage, {}).get("count", 0) for p in profiles) >= 32, stage
    assert (cfg.run_dir / "config.toml").is_file()
    assert (cfg.run_dir / "final" / "model.safetensors").is_file()


def test_two_replicas_stay_bit_identical(tiny_config):
    """Two drafter replicas (and two target chains) on CPU end with identical weights."""
    cfg = tiny_config(
        **{
            "pipeline.drafter_devices": '["cpu", "cpu"]',
            "pipeline.target_devices": '["cpu", "cpu"]',
            "data.num_samples": 40,
        }
    )
    coord = _run(cfg)
    a, b = (r.model.state_dict() for r in coord.replicas)
    assert coord.steps == 3  # 5 batches over 2 replicas: 2 full steps and one with one replica
    init = type(coord.replicas[0].model)(coord.replicas[0].model.spec).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], init[k]) for k in a if "norm" not in k)


def test_max_steps_stops_cleanly(tiny_config):
    """train.max_steps ends the run after that many steps, with reason max_steps."""
    records: list[dict] = []
    coord = _run(tiny_config(**{"train.max_steps": 3, "data.num_samples": 64}), records)
    assert coord.steps == 3
    assert records[-1]["event"] == "run_end" and records[-1]["reason"] == "max_steps"


@pytest.mark.parametrize(
    ("stage", "task"),
    [
        (Stage.PREFETCH, "prefetch"),
        (Stage.TARGET_FORWARD, "target_forward[0]"),
        (Stage.TARGET_PACK, "pack[0]"),
        (Stage.TARGET_D2H, "transfer[0]"),
        (Stage.DRAFTER_FORWARD, "drafter_step[0]"),
        (Stage.OPTIMIZER_STEP, "optimizer"),
    ],
)
def test_failing_stage_ends_run_without_hanging(tiny_config, monkeypatch, stage, task):
    """An exception in any stage ends the run within seconds as a StageError naming it."""
    monkeypatch.setenv("DFLASH_INJECT_FAULT", f"{stage}@2")
    records: list[dict] = []
    t0 = time.perf_counter()
    with pytest.raises(StageError) as info:
        asyncio.run(asyncio.wait_for(_coordinator(tiny_config(), records).run(), timeout=60))
    assert info.value.stage == task
    assert "injected fault" in str(info.value)
    assert time.perf_counter() - t0 < 30
    assert records[-1]["event"] == "run_failed" and records[-1]["stage"] == task


def _coordinator(cfg, records: list) -> Coordinator:
    coord = Coordinator(cfg, log=False)
    coord.subscribe(records.append)
    return coord


def test_embedded_in_callers_loop(tiny_config):
    """Inside a caller's loop the coordinator never blocks it, and stop() ends it cleanly."""
    records: list[dict] = []

    async def main() -> tuple[dict, list[float]]:
        coord = _coordinator(tiny_config(**{"train.epochs": 50}), records)
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.01)

        t = asyncio.create_task(ticker())
        run = asyncio.create_task(coord.run())
        while not any(r["event"] == "train_step" and r["step"] >= 3 for r in records):
            await asyncio.sleep(0.01)
        coord.stop()
        summary = await asyncio.wait_for(run, timeout=30)
        t.cancel()
        return summary, ticks

    summary, ticks = asyncio.run(main())
    assert summary["reason"] == "stopped"
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    # Loading models happens in a thread too; the loop keeps ticking throughout.
    assert max(gaps) < 0.5, max(gaps)
    assert len(ticks) > 50


def test_sigterm_on_real_subprocess(tmp_path):
    """SIGTERM stops a real `bin/dflash run`: exit 0, run_end reason 'stopped', JSON intact."""
    cmd = [
        str(ROOT / "bin" / "dflash"), "run", str(ROOT / "configs" / "tiny.toml"),
        "--set", f'run.output_dir="{tmp_path}"', "--set", "train.epochs=1000",
        "--set", "train.log_every=1", "--set", "data.num_samples=32",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        assert proc.stdout is not None
        deadline = time.time() + 60
        for line in proc.stdout:
            lines.append(line)
            if '"train_step"' in line:
                break
            assert time.time() < deadline
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines += out.splitlines(keepends=True)
    recs = [json.loads(line) for line in lines]
    assert proc.returncode == 0, err
    assert recs[-1]["event"] == "run_end" and recs[-1]["reason"] == "stopped"
    assert "stopping" in err


@pytest.mark.skipif(sys.platform != "linux", reason="relies on os.fork-free subprocess + /proc")
def test_no_stray_stdout_from_library(tiny_config, capfd):
    """With log=False the coordinator writes nothing to stdout (embedding programs own it)."""
    _run(tiny_config(**{"train.max_steps": 1}))
    out, _ = capfd.readouterr()
    assert out == ""
    assert os.environ.get("DFLASH_INJECT_FAULT") is None


def test_serial_mode_trains_exactly_like_the_pipeline(tiny_config, tmp_path):
    """pipeline.mode = "serial" (one worker thread for all stages) gives the same losses as the pipeline."""
    a = []
    _run(tiny_config(**{"train.max_steps": 6, "train.epochs": 2, "eval.at_end": "false"}), a)
    b = []
    other = tiny_config(**{"train.max_steps": 6, "train.epochs": 2, "eval.at_end": "false", "pipeline.mode": '"serial"',
                           "run.output_dir": f'"{tmp_path / "serial"}"'})  # fmt: skip
    _run(other, b)
    la = [r["loss"] for r in a if r["event"] == "train_step"]
    lb = [r["loss"] for r in b if r["event"] == "train_step"]
    assert la == lb and len(la) == 6
