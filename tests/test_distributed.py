"""Several processes on 127.0.0.1 (gloo): the run of W processes × R replicas equals the run
of one process × W·R replicas, a lost rank ends the job with one line, a SIGTERM stops
every rank at the same step, and resume continues exactly. Tiny model, a few steps each.
The torchrun layer of stopping (in-process: tests/test_pipeline.py; the CLI: tests/test_cli.py).
Each of those starts several processes: they are marked slow. `World.wait` (the deadline on
a collective that NCCL only queues) is tested in-process, on fakes of its event and store."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import CLI_TIMEOUT_S, ROOT, dflash, records_until, tiny_overrides

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo on 127.0.0.1")
Popen = Callable[..., subprocess.Popen[str]]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(out: Path, **extra: object) -> list[str]:
    sets = tiny_overrides(out, **{"eval.at_end": "false", "distributed.check_every": 1, **extra})
    return ["run", str(ROOT / "configs" / "tiny.toml"), *(a for kv in sets for a in ("--set", kv))]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def _launch(popen: Popen, n: int, args: list[str], more: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """`n` ranks of `python -m dflash ...`, as torchrun would start them (its env variables)."""
    port = _port()
    procs = []
    for r in range(n):
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), RANK=str(r), LOCAL_RANK=str(r),
                   **(more or {}))  # fmt: skip
        pipe = subprocess.PIPE
        procs.append(popen([sys.executable, "-m", "dflash", *args], env=env, stdout=pipe, stderr=pipe))
    return procs


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each; the timeout is a guard against a hang."""
    done = []
    for p in procs:
        out, err = p.communicate(timeout=CLI_TIMEOUT_S)
        done.append((p.returncode, out, err))
    return done


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps(path: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in _records(path) if r["event"] == "train_step"]


def _weights(run: Path) -> dict:
    return load_file(str(run / "final" / "model.safetensors"))


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def _single(out: Path, replicas: int, **extra: object) -> Path:
    devs = json.dumps(["cpu"] * replicas)
    p = dflash(*_args(out, **{"pipeline.drafter_devices": devs, **extra}), env=_env())
    assert p.returncode == 0, p.stderr[-2000:]
    return out / "tiny"


@pytest.mark.slow
def test_two_processes_equal_one_process_with_two_replicas_under_torchrun(tmp_path):
    """The documented command (torchrun, one node, two processes) gives the same losses and
    bit-identical weights as one process with two replicas: per step both see the same two
    batches, and a sum of two float32 gradients does not depend on their order."""
    extra = {"data.num_samples": 48, "train.epochs": 2}
    one = _single(tmp_path / "one", 2, **extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dflash", *_args(tmp_path / "two", **extra),
           "--log-file", str(tmp_path / "log.{rank}.jsonl")]  # fmt: skip
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=ROOT, timeout=CLI_TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    two = tmp_path / "two" / "tiny"
    stdout = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert {r.get("rank") for r in stdout} == {0}, "stdout carries rank 0's records only"
    start = next(r for r in stdout if r["event"] == "run_start")
    assert (start["world_size"], start["backend"]) == (2, "gloo")
    rank1 = _records(two / "records.rank1.jsonl")
    assert rank1 and all(r["rank"] == 1 for r in rank1)
    for r in (0, 1):  # --log-file with {rank}: one file per rank
        assert {rec["rank"] for rec in _records(tmp_path / f"log.{r}.jsonl")} == {r}
    assert _steps(two / "records.jsonl") == _steps(one / "records.jsonl") == _steps(two / "records.rank1.jsonl")
    assert len(_steps(one / "records.jsonl")) == 6
    assert _same_weights(_weights(two), _weights(one))
    assert not (two / "final.rank1").exists() and len(list((two / "checkpoints").iterdir())) == 1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_each_family_on_two_processes_equals_one_process_with_two_replicas(tmp_path, popen, family):
    """DFlash2's and DSpark's heads (codebooks, Markov and confidence heads) all-reduce as the
    backbone does: two ranks give the losses and bit-identical weights of two replicas."""
    options = {"dflash2": {"drafter.dflash2.selector_rank": 8, "drafter.dflash2.selector_top_k": 4},
               "dspark": {"drafter.dspark.markov_rank": 8}}[family]  # fmt: skip
    extra = {"data.num_samples": 32, "drafter.family": f'"{family}"', **options}
    one = _single(tmp_path / "one", 2, **extra)
    for rc, _, err in _finish(_launch(popen, 2, _args(tmp_path / "two", **extra))):
        assert rc == 0, err[-2000:]
    two = tmp_path / "two" / "tiny"
    assert _steps(two / "records.jsonl") == _steps(one / "records.jsonl") == _steps(two / "records.rank1.jsonl")
    assert len(_steps(one / "records.jsonl")) == 2
    assert _same_weights(_weights(two), _weights(one))


@pytest.mark.slow
def test_uneven_shards_normalise_like_one_process(tmp_path, popen):
    """5 batches over 2 ranks: the last step has data on rank 0 only; rank 1 contributes
    nothing, and the update (divided by the global Σ w) equals the single-process one."""
    extra = {"data.num_samples": 40}
    one = _single(tmp_path / "one", 2, **extra)
    results = _finish(_launch(popen, 2, _args(tmp_path / "two", **extra)))
    for rc, _, err in results:
        assert rc == 0, err[-2000:]
    two = tmp_path / "two" / "tiny"
    assert len(_steps(one / "records.jsonl")) == 3
    assert _steps(two / "records.jsonl") == _steps(one / "records.jsonl") == _steps(two / "records.rank1.jsonl")
    assert _same_weights(_weights(two), _weights(one))


def _wait_for_step(procs: list[subprocess.Popen[str]], step: int) -> None:
    """Block until rank 0 reports `step` on its stdout (its records, one JSON line each)."""
    assert procs[0].stdout is not None
    records_until(procs[0].stdout, lambda r: r["event"] == "train_step" and r["step"] >= step, f"step {step}")


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error" in line]


@pytest.mark.slow
def test_a_killed_rank_ends_the_other_with_one_line(tmp_path, popen):
    """SIGKILL: rank 1 dies mid-run; rank 0 fails at once with one line naming it, not after
    distributed.timeout_s (an hour here: waiting it out would be a hang, which the guard
    on the process ends)."""
    out = tmp_path / "run"
    settings = {"data.num_samples": 512, "train.epochs": 20, "distributed.timeout_s": 3600}
    procs = _launch(popen, 2, _args(out, **settings))
    _wait_for_step(procs, 2)
    procs[1].send_signal(signal.SIGKILL)
    rc, _, err = _finish(procs[:1])[0]
    assert rc != 0
    lines = _error_lines(err)
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith("dflash[rank 0]: error:") and "lost rank 1" in lines[0], lines[0]
    assert procs[1].wait() == -signal.SIGKILL


def _close(a: dict, b: dict, rel: float = 1e-6) -> bool:
    """Equal up to the order of float sums: within `rel` of each tensor's largest entry."""
    return a.keys() == b.keys() and all(
        float((a[k] - b[k]).abs().max()) <= rel * max(float(a[k].abs().max()), 1e-12) for k in a
    )


def _same_steps(a: Path, b: Path, rel: float = 1e-6) -> bool:
    sa, sb = _steps(a), _steps(b)
    return [s[0] for s in sa] == [s[0] for s in sb] and all(
        abs(x[1] - y[1]) <= rel * abs(x[1]) for x, y in zip(sa, sb, strict=True)
    )


def _cut(popen: Popen, n: int, out: Path, extra: dict) -> int:
    """A run of `n` processes stopped by SIGTERM to rank 0 after step 2; the step it stopped at."""
    procs = _launch(popen, n, _args(out, **extra))
    _wait_for_step(procs, 2)
    procs[0].send_signal(signal.SIGTERM)
    results = _finish(procs)
    assert [rc for rc, _, _ in results] == [0] * n, [err[-1000:] for _, _, err in results]
    names = ["records.jsonl", *(f"records.rank{r}.jsonl" for r in range(1, n))]
    ends = [next(r for r in _records(out / "tiny" / f) if r["event"] == "run_end") for f in names]
    assert len({e["steps"] for e in ends}) == 1 and {e["reason"] for e in ends} == {"stopped"}
    return ends[0]["steps"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # three runs of two processes and one of one: ~80 s on two cores, more under load
def test_sigterm_stops_every_rank_at_one_step_and_resume_on_one_process_keeps_the_steps(tmp_path, popen):
    """SIGTERM to rank 0 of two: both ranks stop cleanly (exit 0, run_end "stopped") after
    the same step, one checkpoint of that step holds both ranks' data cursors. `--resume auto`
    on one process (grad_accum "auto" becomes 2: the same global batch) ends with the per-step
    losses and the weights of the uninterrupted two-process run, to float-sum order."""
    extra = {"data.num_samples": 128, "train.epochs": 2, "checkpoint.keep_last": 5}
    full = tmp_path / "full"
    for rc, _, err in _finish(_launch(popen, 2, _args(full, **extra))):
        assert rc == 0, err[-2000:]
    out = tmp_path / "cut"
    stopped = _cut(popen, 2, out, extra)
    total = len(_steps(full / "tiny" / "records.jsonl"))
    assert 2 <= stopped < total
    ckpts = sorted((out / "tiny" / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == [f"step_{stopped:06d}"]
    state = json.loads((ckpts[0] / "state.json").read_text())
    assert state["world"]["size"] == 2 and len(state["world"]["cursors"]) == 2
    assert state["batch"] == {"processes": 2, "replicas": 1, "grad_accum": 1}
    p = dflash(*_args(out, **extra), "--resume", "auto", env=_env())
    assert p.returncode == 0, p.stderr[-2000:]
    rec = next(r for r in _records(out / "tiny" / "records.jsonl") if r["event"] == "resume")
    assert rec["step"] == stopped and not rec["global_batch_changed"] and "grad_accum 2" in rec["global_batch"]
    assert _same_steps(out / "tiny" / "records.jsonl", full / "tiny" / "records.jsonl")
    assert _close(_weights(out / "tiny"), _weights(full / "tiny"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_process_resumed_on_two_keeps_the_steps(tmp_path, popen):
    """One process with grad_accum 2, stopped after step 2, resumed by two processes (grad_accum
    "auto" becomes 1): the losses and weights of the uninterrupted one-process run."""
    extra = {"data.num_samples": 128, "train.epochs": 2, "checkpoint.keep_last": 5}
    full = _single(tmp_path / "full", 1, **extra, **{"train.grad_accum": 2})
    out = tmp_path / "cut"
    stopped = _cut(popen, 1, out, {**extra, "train.grad_accum": 2})
    assert 2 <= stopped < len(_steps(full / "records.jsonl"))
    for rc, _, err in _finish(_launch(popen, 2, [*_args(out, **extra), "--resume", "auto"])):
        assert rc == 0, err[-2000:]
    rec = next(r for r in _records(out / "tiny" / "records.jsonl") if r["event"] == "resume")
    assert rec["global_batch"].startswith("2 batches a step (2 processes × 1 replica × grad_accum 1")
    assert _same_steps(out / "tiny" / "records.jsonl", full / "records.jsonl")
    assert _close(_weights(out / "tiny"), _weights(full))


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun gives each worker a Unix process group of its own)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _wait_for_record(path: Path, what: Callable[[dict], bool], procs: list[subprocess.Popen[str]]) -> None:
    """Poll a run's records file until one satisfies `what` (fails if every process ended)."""
    import time

    while not (path.is_file() and any(what(r) for r in _records_safe(path))):
        assert any(p.poll() is None for p in procs), "every process ended before the record appeared"
        time.sleep(0.2)


def _records_safe(path: Path) -> list[dict]:
    """The complete lines of a records file another process is appending to."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers in /proc")
def test_a_lost_worker_then_a_lost_node_restart_the_job(tmp_path, popen):
    """Two torchrun agents of one process each (`--nnodes 1:2`, c10d rendezvous on 127.0.0.1).
    One worker is SIGKILLed mid-run: torchrun restarts the group of two, which resumes from
    the newest checkpoint. Then one agent is SIGKILLed with its worker: the survivor's worker
    fails in one line, its agent re-forms the group with one node and restarts it; `--resume
    auto` continues on one process (grad_accum "auto": 2), and the job ends with the losses
    and weights of an uninterrupted run of the same global batch."""
    extra = {"data.num_samples": 256, "train.epochs": 2, "checkpoint.every_steps": 1, "checkpoint.keep_last": 3}
    ref = _single(tmp_path / "ref", 1, **extra, **{"train.grad_accum": 2})
    out, port = tmp_path / "elastic", _port()
    conf = "last_call_timeout=8,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120"

    def agent(host: bool) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--max-restarts", "5", "--monitor-interval", "0.5", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lost-node",
               "--rdzv-conf", f"{conf},is_host={int(host)}",
               "-m", "dflash", *_args(out, **extra), "--resume", "auto"]  # fmt: skip
        pipe = subprocess.PIPE
        env = _env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # a store per round: see distributed._launch_warnings
        return popen(cmd, env=env, stdout=pipe, stderr=pipe, start_new_session=True)

    survivor, lost = agent(True), agent(False)
    records = out / "tiny" / "records.jsonl"
    _wait_for_record(records, lambda r: r.get("event") == "train_step" and r["step"] >= 3, [survivor, lost])
    assert next(r for r in _records_safe(records) if r["event"] == "run_start")["world_size"] == 2
    for pid in _children(lost.pid):  # a worker: the group of two restarts
        os.kill(pid, signal.SIGKILL)
    _wait_for_record(records, lambda r: r.get("event") == "resume" and r["from"] is not None, [survivor, lost])
    again = next(r for r in _records_safe(records) if r.get("event") == "resume" and r["from"] is not None)
    assert again["global_batch"].startswith("2 batches a step (2 processes × 1 replica × grad_accum 1")
    _wait_for_record(records, lambda r: r.get("event") == "train_step" and r["step"] >= again["step"] + 2,
                     [survivor, lost])  # fmt: skip
    for pid in [*_children(lost.pid), lost.pid]:  # a node
        os.kill(pid, signal.SIGKILL)
    _, err = survivor.communicate(timeout=CLI_TIMEOUT_S)
    assert survivor.returncode == 0, err[-3000:]
    recs = _records(records)
    resumes = [r for r in recs if r["event"] == "resume"]
    assert resumes[0]["from"] is None  # the first start: no checkpoint yet
    after = resumes[-1]
    assert after["from"] and after["global_batch"].startswith("2 batches a step (1 process × 1 replica × grad_accum 2")
    assert recs[-1]["event"] == "run_end" and recs[-1]["reason"] == "data_exhausted"
    want = {s: loss for s, loss, _ in _steps(ref / "records.jsonl")}
    got = {r["step"]: r["loss"] for r in recs if r["event"] == "train_step"}  # replayed steps: the last
    assert got.keys() == want.keys() and all(abs(got[s] - want[s]) <= 1e-6 * abs(want[s]) for s in want)
    assert _close(_weights(out / "tiny"), _weights(ref))


@pytest.mark.slow
def test_a_hung_rank_ends_the_other_within_the_timeout(tmp_path, popen):
    """SIGSTOP: rank 1 neither dies nor answers; rank 0's collective times out after
    distributed.timeout_s (it says how long it waited: at least that) and names the rank."""
    out = tmp_path / "run"
    procs = _launch(popen, 2, _args(out, **{"data.num_samples": 512, "train.epochs": 20, "distributed.timeout_s": 4}))
    _wait_for_step(procs, 2)
    procs[1].send_signal(signal.SIGSTOP)
    rc, _, err = _finish(procs[:1])[0]
    assert rc != 0
    lines = _error_lines(err)
    assert len(lines) == 1 and "lost rank 1" in lines[0], err[-2000:]
    waited = re.search(r"failed after (\d+) s", lines[0])
    assert waited and int(waited[1]) >= 4, lines[0]


# -- World.wait: the deadline on a collective that NCCL only queues ----------------------------


class _Event:
    """A CUDA event's stand-in: done from its `done_at`-th query on (never: None)."""

    def __init__(self, done_at: int | None) -> None:
        self.done_at, self.queries = done_at, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done_at is not None and self.queries >= self.done_at


class _Store:
    """The rendezvous store's stand-in: fixed values (a heartbeat that never moves is a lost rank)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def _world(timeout_s: float, store: _Store | None, aborted: list[str]):
    """Rank 0 of 2 on NCCL, without a process group: the pieces `wait` uses, as fakes."""
    from types import SimpleNamespace

    from dflash.runtime.distributed import World

    backend = SimpleNamespace(abort=lambda: aborted.append("abort"))
    world = World.__new__(World)
    world.rank, world.size, world.backend, world.timeout_s = 0, 2, "nccl", timeout_s
    world._store = store
    world._dist = SimpleNamespace(group=SimpleNamespace(WORLD=SimpleNamespace(_get_backend=lambda dev: backend)))
    return world


class _Clock:
    """`time` for `distributed`: a clock that only its sleeps move, which it records."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_wait_past_the_deadline_names_the_lost_rank_in_one_line(monkeypatch):
    """A queued all-reduce that never ends (its peer is gone: rank 1's heartbeat stopped):
    after distributed.timeout_s, one line naming what was waited for and the lost rank; the
    polls sleep between them, and the NCCL work is aborted so that no later sync hangs."""
    import itertools

    from dflash.runtime import distributed
    from dflash.runtime.distributed import HEARTBEAT_S, POLL_S, DistributedError

    clock = _Clock()
    monkeypatch.setattr(distributed, "time", clock)
    aborted: list[str] = []
    store = _Store({"dflash/hb/1": "7", "dflash/at/0": "12", "dflash/at/1": "12"})
    world, ready = _world(0.3, store, aborted), _Event(None)
    with pytest.raises(DistributedError) as caught:
        world.wait(ready, "the gradient all-reduce of step 12")
    msg = str(caught.value)
    assert "\n" not in msg
    assert re.fullmatch(
        r"rank 0: the gradient all-reduce of step 12: not done after 0 s: lost rank 1 \(it stopped: no heartbeat\)", msg
    ), msg
    *polls, diagnosis = clock.sleeps
    assert diagnosis == 4 * HEARTBEAT_S  # the heartbeats, read twice that far apart
    # Polled, not spun: a sleep after each query, doubling up to its longest; the deadline
    # passed during the last one.
    assert polls[0] == POLL_S[0] and all(b == min(2 * a, POLL_S[1]) for a, b in itertools.pairwise(polls)), polls
    assert sum(polls[:-1]) < 0.3 <= sum(polls), polls
    assert ready.queries == len(polls) + 1
    assert aborted == ["abort"]


def test_wait_returns_once_the_event_is_done():
    """Done after a few polls: `wait` returns, reads no heartbeat and aborts nothing; no
    event (gloo: the collective ended inside its call) returns at once."""
    import torch

    aborted: list[str] = []
    world, ready = _world(30.0, None, aborted), _Event(4)  # no store: a diagnosis would fail
    world.wait(ready, "the gradient all-reduce of step 3")
    assert ready.queries == 4 and not aborted
    world.wait(None, "the gradient all-reduce of step 3")
    assert world.collective_event(torch.device("cpu")) is None


def test_the_steps_host_sync_waits_for_the_all_reduce_with_a_deadline():
    """`StepSums.read` with ranks: first `World.wait` on the all-reduce's event (NCCL returns
    before the collective ends), then the one host sync; a lost peer raises from the wait."""
    import torch

    from dflash.runtime.distributed import DistributedError
    from dflash.train.reduce import StepSums

    calls: list[tuple[object, str]] = []

    class World:
        def wait(self, ready: object, what: str) -> None:
            calls.append((ready, what))

    stats = torch.tensor([4.0, 1.0, 2.0], dtype=torch.float64)
    sums = StepSums([], stats, torch.zeros(()), torch.zeros(2), None, world=World(), ready="event", what="step 3")
    ok, weight = sums.read(torch.tensor(True))
    assert calls == [("event", "step 3")] and ok and weight == 4.0 and sums.count.tolist() == [1, 2]

    class Lost(World):
        def wait(self, ready: object, what: str) -> None:
            raise DistributedError(f"{what}: not done after 1 s: lost rank 1 (it stopped: no heartbeat)")

    sums.world = Lost()
    with pytest.raises(DistributedError, match="lost rank 1"):
        sums.read(torch.tensor(True))


def test_a_shared_agent_store_with_restarts_is_warned_about(monkeypatch):
    """torchrun's shared TCPStore keeps a dead round's keys: with --max-restarts the run says
    how to give each round its own store."""
    from dflash.runtime.distributed import _launch_warnings

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    (warning,) = _launch_warnings()
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what that variable makes torchrun say
    assert _launch_warnings() == []
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert _launch_warnings() == []


@pytest.mark.slow
def test_two_ranks_sharing_each_batch_equal_one_process(tmp_path, popen):
    """`pipeline.sequence_parallel = 2` with one drafter device a process: two ranks train each
    batch together (each half the context and the blocks, an all-to-all by heads through a gloo
    group of their own), the losses and tokens of one process with one replica, the same weights
    after 20 steps within rtol 1e-5 / atol 1e-6 (the same-weights check passes every step). At a
    small learning rate: AdamW scales each element's update by its own gradient, so float32 sums
    done in another order show in small elements in proportion to the rate."""
    import torch

    extra = {"data.num_samples": 160, "train.epochs": 1, "optimizer.lr": 1e-4}
    one = _single(tmp_path / "one", 1, **extra)
    for rc, _, err in _finish(_launch(popen, 2, _args(tmp_path / "two", **extra, **{"pipeline.sequence_parallel": 2}))):
        assert rc == 0, err[-2000:]
    two = tmp_path / "two" / "tiny"
    a, b = _steps(one / "records.jsonl"), _steps(two / "records.jsonl")
    assert len(a) == len(b) == 20, (a, b)
    assert all(abs(x[1] - y[1]) <= 1e-5 * x[1] for x, y in zip(a, b, strict=True)), (a, b)
    tokens = [[r["tokens"] for r in _records(run / "records.jsonl") if r["event"] == "train_step"]
              for run in (one, two)]  # fmt: skip
    assert tokens[0] == tokens[1]
    wa, wb = (load_file(str(run / "checkpoints" / "step_000020" / "drafter.safetensors")) for run in (one, two))
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "devices"), [(2, ["cpu", "cpu"]), (4, ["cpu"])], ids=["threads", "ranks"])
def test_two_sequence_parallel_groups_equal_one_process_with_two_replicas(tmp_path, popen, ranks, devices):
    """Both kinds of parallelism at once: two sequence-parallel groups of two, data-parallel (two
    torchrun ranks each a group of its two drafter devices, or four ranks with one each in groups of
    two consecutive ranks), train as one process whose two replicas take a batch each: the same
    losses and tokens (each rank counts its own; a group's first member its rows), the same
    weights within rtol 1e-5 / atol 1e-6."""
    import torch

    extra = {"data.num_samples": 96, "train.epochs": 1, "optimizer.lr": 1e-4}
    one = _single(tmp_path / "one", 2, **extra)
    group = {"pipeline.drafter_devices": json.dumps(devices), "pipeline.sequence_parallel": 2}
    for rc, _, err in _finish(_launch(popen, ranks, _args(tmp_path / "sp", **extra, **group))):
        assert rc == 0, err[-2000:]
    sp = tmp_path / "sp" / "tiny"
    a, b = _steps(one / "records.jsonl"), _steps(sp / "records.jsonl")
    assert len(a) == len(b) >= 5, (a, b)
    assert all(abs(x[1] - y[1]) <= 1e-5 * x[1] for x, y in zip(a, b, strict=True)), (a, b)
    logs = [one / "records.jsonl", sp / "records.jsonl", *(sp / f"records.rank{r}.jsonl" for r in range(1, ranks))]
    tokens = [[r["tokens"] for r in _records(log) if r["event"] == "train_step"] for log in logs]
    assert tokens[0] == [sum(t) for t in zip(*tokens[1:], strict=True)]
    wa, wb = _weights(one), _weights(sp)
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_to_one_rank_of_a_sequence_parallel_group_stops_both_at_one_step(tmp_path, popen):
    """Two ranks sharing each batch, eight micro-batches a step, shallow queues: SIGTERM to rank 0 stops both
    cleanly after the same step (its prefetch goes on until the stop the ranks agree on, so its
    partner never waits in an exchange for a batch it will not take); the run resumes on one
    process."""
    extra = {"data.num_samples": 512, "train.grad_accum": 8, "pipeline.sequence_parallel": 2,
             "pipeline.hs_queue_depth": 1, "pipeline.batch_queue_depth": 1, "distributed.timeout_s": 60}  # fmt: skip
    out = tmp_path / "cut"
    stopped = _cut(popen, 2, out, extra)
    assert stopped >= 2
    one = {**extra, "pipeline.sequence_parallel": 1}
    p = dflash(*_args(out, **one), "--resume", "auto", env=_env())
    assert p.returncode == 0, p.stderr[-2000:]
    rec = next(r for r in _records(out / "tiny" / "records.jsonl") if r["event"] == "resume")
    assert rec["step"] == stopped and not rec["global_batch_changed"]


def test_every_rank_writes_its_own_tracker_runs_with_trackers_all_ranks(tmp_path, popen):
    """`run.trackers_all_ranks`: each of two ranks writes its own run to every tracker, the loss
    series its own records hold — TensorBoard and MLflow to files of their own, wandb and Trackio
    under names by rank (rank 0 alone writes without it)."""
    import sqlite3

    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    four = '["tensorboard", "wandb", "mlflow", "trackio"]'
    extra = {"data.num_samples": 32, "run.trackers": four, "run.trackers_all_ranks": "true"}
    env = {"WANDB_MODE": "offline", "TRACKIO_DIR": str(tmp_path / "trackio"), "HOME": str(tmp_path)}
    for rc, _, err in _finish(_launch(popen, 2, _args(tmp_path, **extra), env)):
        assert rc == 0, err[-2000:]
    run = tmp_path / "tiny"
    assert sorted(p.name for p in (run / "tensorboard").iterdir()) == ["rank0", "rank1"]
    assert len(list((run / "wandb").glob("offline-run-*/run-*.wandb"))) == 2
    trackio = sqlite3.connect(tmp_path / "trackio" / "dflash.db")
    for rank, log in ((0, "records.jsonl"), (1, "records.rank1.jsonl")):
        losses = {step: loss for step, loss, _ in _steps(run / log)}
        board = EventAccumulator(str(run / "tensorboard" / f"rank{rank}"))
        board.Reload()
        assert {e.step: e.value for e in board.Scalars("train/loss")} == pytest.approx(losses, abs=1e-6)
        client = MlflowClient(tracking_uri=f"sqlite:///{run / f'mlflow.rank{rank}.db'}")
        (found,) = client.search_runs([client.get_experiment_by_name("dflash").experiment_id])
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")}
        assert found.info.run_name == f"tiny.rank{rank}" and history == pytest.approx(losses, abs=1e-6)
        rows = trackio.execute("select step, metrics from metrics where run_name = ?", (f"tiny.rank{rank}",))
        kept = {s: json.loads(m)["train/loss"] for s, m in rows if "train/loss" in json.loads(m)}
        assert kept == pytest.approx(losses, abs=1e-6)
