"""Shared fixtures: a tiny config that runs the whole pipeline in a second or two, and one
short real `bin/dflash run` that the CLI and report tests share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
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
# a hang fails, not a loaded machine; below pytest's limit per test (pytest.ini), so that a
# hung subprocess is killed and its test fails alone.
CLI_TIMEOUT_S = 240

# One intra-op thread per process, in this one and in the processes the tests start (they
# inherit the variable): the pipeline runs its stages in parallel threads already, and on two
# cores shared with other work, torch's thread pools waiting for a core make a tiny run's
# set-up 15x slower (measured at load 5: 31 s with two threads, 1.8 s with one). The losses
# are the same (tests/golden). An OMP_NUM_THREADS set beforehand is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# `make test` starts the tests once .venv is ready and makes what only some of them need
# meanwhile, in the background, in two chains: .venv-engines (vLLM, speculators) and llama.cpp's
# build; `<DFLASH_TESTS_SETUP>.vllm` and `.llamacpp` then hold each chain's exit status once it is
# done. A test file marked `engines("vllm")` or `engines("llamacpp")` (no argument: both) runs
# last (below), the vLLM ones first, and waits for its chains, outside its time limit.
SETUP_PREFIX = os.environ.get("DFLASH_TESTS_SETUP")
SETUP_WAIT_S = 3600  # far above a first build on a slow machine: only a hung set-up
SETUPS = ("vllm", "llamacpp")


def _needs(item: pytest.Item) -> tuple[str, ...]:
    """The background set-ups a test waits for: its `engines` marker's arguments (none: all)."""
    marker = item.get_closest_marker("engines")
    return () if marker is None else tuple(marker.args) or SETUPS


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that need the background set-up last, those needing llama.cpp's build (the
    longest) after the vLLM ones (a stable sort: whole files, as `engines` marks files), so that
    by the time a worker reaches them it is mostly done."""
    items.sort(key=lambda item: (bool(_needs(item)), "llamacpp" in _needs(item)))


_setup_deadline: float | None = None  # one wait for the whole test run, not one per test


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Before pytest-timeout starts the test's clock: the wait for the background set-ups the
    test needs (the Makefile writes each status whole, by a rename)."""
    global _setup_deadline
    if SETUP_PREFIX and _needs(item):
        if _setup_deadline is None:
            _setup_deadline = time.monotonic() + SETUP_WAIT_S
        for part in _needs(item):
            while not Path(f"{SETUP_PREFIX}.{part}").exists() and time.monotonic() < _setup_deadline:
                time.sleep(1.0)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `engines` fails in one line where a background set-up it needs failed,
    before any of its fixtures is made."""
    if not SETUP_PREFIX:
        return
    for part in _needs(item):
        status = Path(f"{SETUP_PREFIX}.{part}")
        code = status.read_text().strip() if status.exists() else f"none after {SETUP_WAIT_S} s"
        if code != "0":
            pytest.fail(f"make test's set-up of {part} failed (exit status {code}): see {SETUP_PREFIX}.log")


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


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a real tokenizer, saved once a test file (tests/tiny_llama.py)."""
    from tests.tiny_llama import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama") / "model")


@pytest.fixture
def tiny_config(tmp_path: Path):
    from dflash import load_config

    def make(**extra: object):
        return load_config(ROOT / "configs" / "tiny.toml", tiny_overrides(tmp_path, **extra))

    return make


def run_records(
    cfg: Any,
    into: list[dict[str, Any]] | None = None,
    timeout_s: float | None = None,
    subscribers: tuple[Any, ...] | list[Any] = (),
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Run a Coordinator on `cfg` to its end; every record it emitted, in order.

    `into`: append the records to this list as they come, so that a test expecting the run
    to raise still sees what came before. `timeout_s`: a guard against a hang (TimeoutError),
    not a speed limit. `subscribers`: more record subscribers, after the list's. Other keyword
    arguments go to the Coordinator."""
    import asyncio

    from dflash import Coordinator

    records: list[dict[str, Any]] = [] if into is None else into
    coord = Coordinator(cfg, log=False, **kwargs)
    coord.subscribe(records.append)
    for fn in subscribers:
        coord.subscribe(fn)
    asyncio.run(asyncio.wait_for(coord.run(), timeout_s))
    return records


def dflash(
    *args: str,
    env: dict[str, str] | None = None,
    input: str | None = None,
    timeout: float = CLI_TIMEOUT_S,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run bin/dflash from the repository root, DFLASH_PROFILE_INTERVAL cleared unless `env` sets it.
    A process forked from a server that has imported torch, transformers and dflash already
    (tests/cli_child.py); `fresh` (or DFLASH_TESTS_FRESH_CLI=1 for every call): bin/dflash
    itself, a new interpreter."""
    full_env = {k: v for k, v in os.environ.items() if k != "DFLASH_PROFILE_INTERVAL"}
    full_env.update(env or {})
    if fresh or os.environ.get("DFLASH_TESTS_FRESH_CLI") == "1":
        return subprocess.run(
            [str(DFLASH), *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT, input=input
        )
    return _forked_cli(list(args), full_env, input, timeout)


_cli_server: Any = None  # the multiprocessing context whose forkserver has dflash imported


def _root_first(pythonpath: str | None) -> str:
    return os.pathsep.join(filter(None, [str(ROOT), pythonpath]))


def _server() -> Any:
    """The multiprocessing context whose forkserver has imported tests.cli_child (started once)."""
    global _cli_server
    import multiprocessing
    from multiprocessing import forkserver
    from unittest import mock

    if _cli_server is None:
        _cli_server = multiprocessing.get_context("forkserver")
        _cli_server.set_forkserver_preload(["tests.cli_child"])
        # The server imports tests.cli_child from the checkout: its sys.path comes from the
        # environment it starts in, not from ours.
        with mock.patch.dict(os.environ, {"PYTHONPATH": _root_first(os.environ.get("PYTHONPATH"))}):
            forkserver.ensure_running()
    return _cli_server


def forked_context() -> Any:
    """The multiprocessing context whose server has imported torch, transformers and dflash
    (started once): its `Process` forks a test's own child body (a module-level function) from
    that server, with no imports of its own to make."""
    return _server()


def _forked_cli(
    args: list[str], env: dict[str, str], input: str | None, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`bin/dflash ARGS` forked (`ForkedPopen`), run to its end as `subprocess.run` would: done
    when no process (a server the CLI left running) holds its output any more."""
    cmd = [str(DFLASH), *args]
    pipe = subprocess.PIPE
    proc = ForkedPopen(cmd, args, env, ROOT, pipe, pipe, stdin=pipe if input is not None else None)
    try:
        out, err = proc.communicate(input, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            out, err = proc.communicate(timeout=5.0)
        except subprocess.TimeoutExpired:  # a process it started still holds the output
            out = err = ""
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    if proc.returncode and not out and not err:
        msg = f"the forked CLI died before running (exit {proc.returncode}): its server's stderr has the cause; {cmd}"
        raise RuntimeError(msg)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class ForkedPopen:
    """`subprocess.Popen(cmd, text=True, ...)` of `bin/dflash ARGS` (or `python -m dflash
    ARGS`), the process forked from the server as `dflash()` forks it, for the tests that
    signal a run or read its output as it comes: stdout and stderr pipes (or /dev/null, the
    test's own, or an open file of the caller's), stdin a pipe for `communicate`'s input,
    else /dev/null; pid, poll, wait, communicate, send_signal, terminate, kill and returncode
    as Popen's (a signal's end: minus its number). `child`: the child's body instead of
    `cli_child.run_cli` (called with its arguments; a module-level function or a partial of
    one, as the server imports it)."""

    def __init__(
        self, cmd: list[str], args: list[str], env: dict[str, str], cwd: Path | str, stdout: Any, stderr: Any,
        stdin: Any = None, child: Callable[..., None] | None = None,
    ):  # fmt: skip
        from tests import cli_child

        self.args, self.stdin = cmd, None
        ends: dict[str, Any] = {"stdin": os.devnull}
        mine: list[int] = []  # the child's ends of the pipes, closed here once it has them
        if stdin == subprocess.PIPE:
            r, w = os.pipe()
            self.stdin = open(w, "w", encoding="utf-8")  # noqa: SIM115
            ends["stdin"], mine = cli_child.Fd(r), [r]
        for name, how in (("stdout", stdout), ("stderr", stderr)):
            if how == subprocess.PIPE:
                r, w = os.pipe()
                setattr(self, name, open(r, encoding="utf-8", errors="replace"))  # noqa: SIM115
                ends[name], mine = cli_child.Fd(w), [*mine, w]
            elif how == subprocess.DEVNULL:
                setattr(self, name, None)
                ends[name] = os.devnull
            elif how is None:
                setattr(self, name, None)
                ends[name] = cli_child.Fd(1 if name == "stdout" else 2)
            elif hasattr(how, "fileno"):  # a file of the caller's, written by the child directly
                setattr(self, name, None)
                ends[name] = cli_child.Fd(how.fileno())
            else:
                raise ValueError(f"ForkedPopen: {name}={how!r} (PIPE, DEVNULL, None or a file)")
        env = {**env, "PYTHONPATH": _root_first(env.get("PYTHONPATH"))}  # as bin/dflash
        self._proc = _server().Process(
            target=child or cli_child.run_cli,
            args=(args, env, str(cwd), ends["stdin"], ends["stdout"], ends["stderr"]),
            daemon=False,
        )
        try:
            self._proc.start()
        finally:
            for fd in mine:
                os.close(fd)
        self.pid: int = self._proc.pid
        self._read: dict[str, list[str]] | None = None

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._proc.exitcode

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Reads both pipes to their end (beside each other, as Popen), then waits."""
        if input and self.stdin is None:
            raise ValueError("ForkedPopen: input without stdin=PIPE")
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {n: s for n in ("stdout", "stderr") if (s := getattr(self, n)) is not None}
        if self._read is None:
            self._read = {n: [] for n in streams}
            self._readers = [
                threading.Thread(target=lambda s=s, into=self._read[n]: into.append(s.read()), daemon=True)
                for n, s in streams.items()
            ]
            if self.stdin is not None:  # written beside the reads: a pipe holds 64 KiB

                def write(f: Any = self.stdin, text: str = input or "") -> None:
                    with f:
                        f.write(text)

                self._readers.append(threading.Thread(target=write, daemon=True))
            for t in self._readers:
                t.start()
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for s in streams.values():
            s.close()
        return tuple("".join(self._read[n]) if n in self._read else None for n in ("stdout", "stderr"))  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended, its status not yet passed on by the server
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen_cli(cmd: list[str], fresh: bool = False, **kwargs: Any) -> Any:
    """`subprocess.Popen(cmd, text=True, cwd=ROOT, **kwargs)`, or, for `bin/dflash ARGS`,
    `python -m dflash ARGS` and `python -c CODE ARGS` with pipes, /dev/null or the test's
    streams (unless `fresh` or DFLASH_TESTS_FRESH_CLI=1), a `ForkedPopen` of it: no new
    interpreter importing torch."""
    kwargs = {"cwd": ROOT, **kwargs}
    child = None
    if cmd[:1] == [str(DFLASH)]:
        args = cmd[1:]
    elif cmd[:3] == [sys.executable, "-m", "dflash"]:
        args = cmd[3:]
    elif cmd[:2] == [sys.executable, "-c"] and len(cmd) > 2:
        from tests import cli_child

        args, child = cmd[2:], cli_child.run_code
    else:
        args = None
    forkable = set(kwargs) <= {"cwd", "env", "stdout", "stderr"} and all(
        kwargs.get(n) in (None, subprocess.PIPE, subprocess.DEVNULL) for n in ("stdout", "stderr")
    )
    if args is None or not forkable or fresh or os.environ.get("DFLASH_TESTS_FRESH_CLI") == "1":
        return subprocess.Popen(cmd, text=True, **kwargs)
    env = kwargs.get("env")
    proc = ForkedPopen(cmd, args, dict(os.environ if env is None else env), kwargs["cwd"],
                       kwargs.get("stdout"), kwargs.get("stderr"), child=child)  # fmt: skip
    if not _forked:  # before multiprocessing's own exit handler, which would wait for them
        import atexit

        atexit.register(lambda: [p.kill() for p in _forked])
    _forked.append(proc)
    return proc


_forked: list[ForkedPopen] = []  # killed at exit if still running: a test that left one behind


ENGINES_PY = ROOT / ".venv-engines" / "bin" / "python"
_engines_server: tuple[subprocess.Popen[str], str] | None = None  # this worker's (tests/engines_child.py)


def _engines_socket() -> str:
    """The socket of this worker's fork server in .venv-engines, started at its first call (2 min
    at most); it ends, its folder removed, as the worker exits (or, killed, as its stdin closes)."""
    global _engines_server
    if _engines_server is None or _engines_server[0].poll() is not None:
        import select
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="dflash-engines-"))
        env = {**os.environ, "PYTHONPATH": _root_first(os.environ.get("PYTHONPATH")), "HF_HUB_OFFLINE": "1"}
        with open(folder / "server.log", "w", encoding="utf-8") as log:
            pipe = subprocess.PIPE
            proc = subprocess.Popen([str(ENGINES_PY), "-m", "tests.engines_child", str(folder / "sock")], text=True,
                                    stdin=pipe, stdout=pipe, stderr=log, cwd=ROOT, env=env)  # fmt: skip
        assert proc.stdout is not None
        started = select.select([proc.stdout], [], [], 120.0)[0] and proc.stdout.readline().strip() == "ready"
        if not started:
            _stop_engines_server(proc, None)
            msg = f"the fork server in .venv-engines did not start: {(folder / 'server.log').read_text()[-2000:]}"
            raise RuntimeError(msg)
        _engines_server = (proc, str(folder / "sock"))
        import atexit

        atexit.register(_stop_engines_server, proc, folder)
    return _engines_server[1]


def _stop_engines_server(proc: subprocess.Popen[str], folder: Path | None) -> None:
    import shutil

    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()  # stdin's end: its cue to end
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _engines_log() -> str:
    path = Path(_engines_server[1]).with_name("server.log") if _engines_server else None
    return path.read_text(errors="replace")[-2000:] if path is not None and path.exists() else ""


def engines_python(
    args: list[str], env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT_S, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """`.venv-engines/bin/python ARGS` (`-m MODULE ...` or `SCRIPT ...`) run to its end as
    `subprocess.run(..., capture_output=True, text=True)` would, forked from this worker's server
    there (vLLM, torch, transformers and dflash imported once: tests/engines_child.py); with
    DFLASH_TESTS_FRESH_CLI=1 a new interpreter. A timeout, or any failure here, kills the child
    (the server does: its pid is not yet reaped)."""
    import socket
    import struct

    cmd = [str(ENGINES_PY), *args]
    full_env = dict(os.environ if env is None else env)
    if os.environ.get("DFLASH_TESTS_FRESH_CLI") == "1":
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)
    payload = json.dumps({"argv": list(args), "env": full_env, "cwd": str(cwd)}).encode()
    ends = [*os.pipe(), *os.pipe(), *os.pipe()]  # stdin r/w, stdout r/w, stderr r/w
    theirs = [ends[0], ends[3], ends[5]]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(_engines_socket())
            socket.send_fds(conn, [struct.pack("!I", len(payload))], theirs)
            conn.sendall(payload)
            for fd in (*theirs, ends[1]):  # the child's ends are its own now; no input
                os.close(fd)
            theirs, ends = [], [ends[2], ends[4]]
            return _engines_wait(conn, cmd, ends, timeout)
    finally:
        for fd in (*theirs, *ends):
            try:
                os.close(fd)
            except OSError:  # closed with its file object
                pass


def _engines_wait(conn: Any, cmd: list[str], ends: list[int], timeout: float) -> subprocess.CompletedProcess[str]:
    """The child's output and status; on a timeout or any failure, a kill sent to the server."""
    import socket
    import struct

    def exactly(n: int) -> bytes:
        data = conn.recv(n, socket.MSG_WAITALL)
        if len(data) != n:
            raise RuntimeError(f"the fork server in .venv-engines went away; its log: {_engines_log()}")
        return data

    streams = [open(fd, encoding="utf-8", errors="replace", closefd=False) for fd in ends]  # noqa: SIM115
    got = ["", ""]
    try:
        exactly(8)  # the child's pid: the server kills it if asked
        readers = [threading.Thread(target=lambda i=i: got.__setitem__(i, streams[i].read()), daemon=True)
                   for i in range(2)]  # fmt: skip
        for r in readers:
            r.start()
        deadline = time.monotonic() + timeout
        for r in readers:
            r.join(max(0.0, deadline - time.monotonic()))
        if any(r.is_alive() for r in readers):
            raise subprocess.TimeoutExpired(cmd, timeout, output=got[0], stderr=got[1])
        conn.settimeout(max(5.0, deadline - time.monotonic()))
        code = struct.unpack("!i", exactly(4))[0]
    except BaseException:
        try:
            conn.sendall(b"k")
        except OSError:
            pass
        raise
    return subprocess.CompletedProcess(cmd, code, got[0], got[1])


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
        env={"DFLASH_PROFILE_INTERVAL": "0.25"}, fresh=True,  # bin/dflash itself, a new interpreter
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


def records_until(lines: Iterable[str], want: Callable[[dict[str, Any]], bool], what: str) -> list[dict[str, Any]]:
    """Read a process's JSON-lines stdout up to and including the first record `want` accepts
    (blocking reads: the process's own progress is the clock); fails if the stream ends first."""
    records = []
    for line in lines:
        records.append(json.loads(line))
        if want(records[-1]):
            return records
    pytest.fail(f"the process ended before {what}")


def lines_until(lines: Iterable[str], text: str) -> list[str]:
    """Read a stream (a process's stderr) up to and including the first line holding `text`."""
    seen = []
    for line in lines:
        seen.append(line)
        if text in line:
            return seen
    pytest.fail(f"the stream ended without {text!r}: {''.join(seen)[-2000:]}")


@pytest.fixture
def popen() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """`popen(cmd, fresh=False, **kwargs)`: a text-mode Popen from the repository root
    (`popen_cli`: `bin/dflash` forked unless `fresh`) whose process is killed at teardown if
    still running, so that a failed test leaves no process behind."""
    started: list[subprocess.Popen[str]] = []

    def start(cmd: list[str], fresh: bool = False, **kwargs: Any) -> subprocess.Popen[str]:
        proc = popen_cli(cmd, fresh=fresh, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
