"""`target.engine = "remote"` (dflash/targets/spool_*.py): a `dflash serve-target` process —
here `--engine local`, the whole target in PyTorch, standing in for an engine on another host
— answers the run's batches through a spool folder; the run holds the target's head only. The
losses are the in-process target's; a server killed mid-run and a folder that vanishes each end
the run in one line naming the stage and the folder, with the checkpoints written so far whole."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.conftest import CLI_TIMEOUT_S, DFLASH, ROOT, ForkedPopen, dflash, json_lines, popen_cli
from tests.test_engine_features import LIVE, _setup

REMOTE = ["--set", 'target.engine="remote"', "--set", 'target.load="head"']


def _serve(config: Path, spool: Path) -> subprocess.Popen[str]:
    """The server, its scratch folder in the test's (one it leaves when a test kills it stays there)."""
    return popen_cli(
        [str(DFLASH), "serve-target", str(config), "--engine", "local", "--spool", str(spool), "--device", "cpu",
         "--set", 'target.dtype="float32"'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(spool.parent)},
    )  # fmt: skip


def test_a_remote_target_trains_as_the_in_process_one(tmp_path):
    """20 steps fed by a server through the spool equal the in-process target's to 1e-5; the
    folder never held more than one batch; the server exits when the run ends; the profile
    times the wait and the hand-off read."""
    config, spool = _setup(tmp_path), tmp_path / "spool"
    server = _serve(config, spool)
    try:
        sets = [*LIVE, *REMOTE, "--set", f'target.engine_spool="{spool}"', "--set", 'run.name="remote"']
        remote = dflash("run", str(config), *sets)
        assert remote.returncode == 0, remote.stderr[-3000:]
        out, err = server.communicate(timeout=60)
    finally:
        server.kill()
    assert server.returncode == 0, err[-3000:]
    local = dflash("run", str(config), *LIVE, "--set", 'run.name="local"')
    assert local.returncode == 0, local.stderr[-2000:]

    def losses(text: str) -> list[float]:
        return [r["loss"] for r in json_lines(text) if r["event"] == "train_step"]

    a, b = losses(remote.stdout), losses(local.stdout)
    assert len(a) == len(b) == 20
    assert all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b, strict=True)), (a, b)
    engine = json_lines(remote.stdout)[-1]["target_engine"]
    assert engine["engine"] == "remote" and 0 < engine["spool_max"] <= 6  # data.batch_size documents
    served = [r for r in json_lines(out) if r["event"] == "serve_end"]
    assert served and served[0]["documents"] == engine["requests"] and served[0]["refused"] == 0
    assert sorted(p.name for p in spool.iterdir()) == []  # answered, read, deleted; the server's files gone
    stages = {n for r in json_lines(remote.stdout) if r["event"] == "profile" for n in r["stages"]}
    assert {"target.engine_wait", "target.engine_read"} <= stages and "target.model_forward" not in stages


class _RacingClock:
    """spool_client's `time` in a run whose server gets killed: real time until the file
    `ahead` exists, then each reading an hour after the one before. Once the server is dead,
    the run's next check of the heartbeat sees at most one beat it had not seen, and the one
    after misses the beat: no timeout is waited out, so target.engine_timeout_s can be one
    that a loaded machine never reaches while the server lives."""

    sleep = staticmethod(time.sleep)

    def __init__(self, ahead: Path) -> None:
        self.ahead, self.hours = ahead, 0

    def monotonic(self) -> float:
        if self.ahead.exists():
            self.hours += 1
        return time.monotonic() + 3600.0 * self.hours


def _run_with_a_racing_clock(ahead: str, *cli: Any) -> None:
    """The forked run's body (`ForkedPopen`'s `child`): the CLI, on `_RacingClock(ahead)`."""
    from dflash.targets import spool_client
    from tests import cli_child

    spool_client.time = _RacingClock(Path(ahead))  # type: ignore[assignment]
    cli_child.run_cli(*cli)


TIMEOUT_S = 60  # target.engine_timeout_s below: only a hung server would miss beats that long


def _stopped_mid_run(tmp_path: Path, stop: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A long run against a server; once its second checkpoint is written, the server is killed
    (`stop` = "kill", then the run's heartbeat clock races ahead) or the folder removed
    ("vanish")."""
    config, spool, ahead = _setup(tmp_path), tmp_path / "spool", tmp_path / "clock-ahead"
    server = _serve(config, spool)
    sets = [*REMOTE, "--set", f'target.engine_spool="{spool}"', "--set", f"target.engine_timeout_s={TIMEOUT_S}",
            "--set", "train.epochs=1000", "--set", "checkpoint.every_steps=2", "--set", 'target.dtype="float32"',
            "--set", "data.feature_cache_mb=0", "--set", "data.feature_files=false"]  # fmt: skip
    cmd, pipe = [str(DFLASH), "run", str(config), *sets], subprocess.PIPE
    if stop == "kill":  # forked, as popen_cli would, with the run's clock set first
        child = functools.partial(_run_with_a_racing_clock, str(ahead))
        run = ForkedPopen(cmd, cmd[1:], dict(os.environ), ROOT, pipe, pipe, child=child)
    else:
        run = popen_cli(cmd, stdout=pipe, stderr=pipe)
    checkpoints = tmp_path / "runs" / "feats" / "checkpoints"
    try:
        deadline = time.monotonic() + 120  # a hang guard: the checkpoints come in seconds
        while len(list(checkpoints.glob("step_*"))) < 2:
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read() if run.stderr else ""
            time.sleep(0.05)
        if stop == "kill":
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=60)  # it beats no more
            ahead.touch()
        else:  # the run and the server write into it meanwhile: remove until it stays gone
            end = time.monotonic() + 30
            while spool.exists() and time.monotonic() < end:
                shutil.rmtree(spool, ignore_errors=True)
            assert not spool.exists()
        out, err = run.communicate(timeout=CLI_TIMEOUT_S)  # a hang guard: the run ends at its next check
    finally:
        run.kill()
        server.kill()
        server.communicate()
    return subprocess.CompletedProcess(run.args, run.returncode, out, err), checkpoints


def _one_line_and_checkpoints_whole(proc: subprocess.CompletedProcess[str], checkpoints: Path, says: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and says in lines[0], proc.stderr[-3000:]
    steps = sorted(checkpoints.glob("step_*"))
    assert len(steps) >= 2
    for step in steps:
        assert json.loads((step / "state.json").read_text())["step"] == int(step.name.removeprefix("step_"))


def test_a_remote_engine_that_dies_ends_the_run_in_one_line(tmp_path):
    proc, checkpoints = _stopped_mid_run(tmp_path, "kill")
    _one_line_and_checkpoints_whole(proc, checkpoints, "target.engine_wait: the engine serving")
    assert f"stopped: no heartbeat for {TIMEOUT_S} s" in proc.stderr


def test_a_spool_folder_that_vanishes_ends_the_run_in_one_line(tmp_path):
    proc, checkpoints = _stopped_mid_run(tmp_path, "vanish")
    _one_line_and_checkpoints_whole(proc, checkpoints, f"the spool folder {tmp_path / 'spool'} is gone")


def test_a_remote_target_is_refused_without_its_folder(tmp_path):
    """No `target.engine_spool`, or one that cannot be made: one line before training; no
    server on it: one line once `target.engine_timeout_s` has passed."""
    config = _setup(tmp_path)
    proc = dflash("run", str(config), *REMOTE)
    assert proc.returncode == 2 and "target.engine = 'remote' needs target.engine_spool" in proc.stderr
    (tmp_path / "file").write_text("")
    proc = dflash("run", str(config), *REMOTE, "--set", f'target.engine_spool="{tmp_path / "file" / "spool"}"')
    assert proc.returncode == 2 and "cannot make the folder" in proc.stderr, proc.stderr
    spool = tmp_path / "nobody"
    proc = dflash("run", str(config), *REMOTE, "--set", f'target.engine_spool="{spool}"', "--set",
                  "target.engine_timeout_s=1", "--set", "data.feature_files=false")  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert f"target.engine_wait: the engine serving {spool} is not running: no heartbeat for 1 s" in lines[0]


def test_a_vllm_engine_that_dies_mid_call_ends_the_wait_in_one_line(monkeypatch):
    """`target.engine = "vllm"`: vLLM 0.32's offline client marks its engine dead when the
    engine core's process exits but leaves `generate` waiting on its output queue forever; the
    target's watcher hands that wait an error, which ends the stage in one line."""
    import queue
    import threading
    from types import SimpleNamespace

    import pytest

    from dflash.errors import DataError
    from dflash.targets import live

    outputs: queue.Queue = queue.Queue()
    client = SimpleNamespace(resources=SimpleNamespace(engine_dead=False), outputs_queue=outputs)

    def generate(_llm, _prompts):  # vLLM's SyncMPClient.get_output: blocks until something arrives
        client.resources.engine_dead = True  # the engine core's process exits while generate waits
        got = outputs.get(timeout=30)  # a hang guard only: the watcher answers within its poll
        raise got if isinstance(got, Exception) else AssertionError(got)

    monkeypatch.setattr(live, "generate_hidden", generate)
    target = object.__new__(live.EngineTarget)
    target.spool, target._lock = Path("."), threading.Lock()
    target._llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))
    target._watch, target._dead = threading.Event(), threading.Event()
    threading.Thread(target=target._watch_engine, daemon=True).start()
    monkeypatch.setattr(live, "prompts_of", lambda _b: ([7], [[1, 2, 3]]))
    with pytest.raises(DataError, match=r"target\.engine_wait: the vLLM engine failed: its engine core process exited"):
        target.engine_call(SimpleNamespace())
    target._watch.set()


class _Clock:
    """`time` for spool_client: a clock that only its sleeps move; `at_sleep` runs at each."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, 0
        self.at_sleep = lambda: None

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        self.at_sleep()


def test_a_folder_being_removed_counts_as_removed(tmp_path, monkeypatch):
    """A removal deletes the folder's files before the folder: a request can vanish a moment
    before its folder does. The wait then says the folder is gone once it is (within a grace),
    and that the request vanished only where the folder stays."""
    from dflash.targets import spool_client
    from dflash.targets.spool_client import SpoolTarget

    clock = _Clock()
    monkeypatch.setattr(spool_client, "time", clock)
    client = object.__new__(SpoolTarget)  # only its folder matters here
    client.spool = tmp_path / "spool"
    client.spool.mkdir()
    assert not client._removed(grace_s=0.05)  # a folder that stays: the request itself was lost
    assert clock.now > 0.05 and clock.sleeps > 1  # polled through the grace
    clock.now, clock.sleeps = 0.0, 0
    clock.at_sleep = lambda: shutil.rmtree(client.spool, ignore_errors=True)  # gone while the wait polls
    assert client._removed(grace_s=5.0)
    assert clock.sleeps == 1


def test_an_answer_that_vanishes_with_its_folder_names_the_folder(tmp_path, monkeypatch):
    """The run's read of an answer can come between the removal of the answer's file and that
    of its folder: the error then names the folder, as the wait does; an answer lost from a
    folder that stays is named itself."""
    import pytest
    import torch

    from dflash.errors import DataError
    from dflash.targets import spool_client
    from dflash.targets.spool_client import SpoolTarget

    monkeypatch.setattr(spool_client, "time", _Clock())  # the grace for the folder to go: no wait
    client = object.__new__(SpoolTarget)  # only its folder matters here
    client.spool = tmp_path / "spool"
    client.spool.mkdir()
    pending = ([0], torch.zeros(1, dtype=torch.int32), client.spool / "out-x.safetensors")
    with pytest.raises(DataError, match=r"target\.engine_read: the engine's answer .*out-x\.safetensors is gone"):
        client.engine_read(None, pending)
    client.spool.rmdir()
    gone = rf"target\.engine_read: the spool folder {re.escape(str(client.spool))} is gone"
    with pytest.raises(DataError, match=gone):
        client.engine_read(None, pending)
