"""`.venv-engines/bin/python ARGS` as the tests run it: a real process, forked from a server in
that venv that has imported vLLM, torch, transformers and dflash once (one server per test
worker, started at its first such call), instead of a fresh interpreter importing them again
(~7 CPU-s a call, ten calls a suite). `tests/cli_child.py` does the same for `.venv`; this one
cannot be multiprocessing's forkserver, whose interpreter is the tests' own.

Protocol, over a UNIX socket, one connection a call: the caller sends a 4-byte length with its
three pipe ends (stdin, stdout, stderr) as SCM_RIGHTS, then that many bytes of JSON (`argv`:
python's arguments, `-m MODULE ...` or `SCRIPT ...`; `env`; `cwd`); the server forks, sends the
child's pid (8 bytes), then, once the child has ended, its status as `subprocess` gives it (4
bytes, signed: minus the signal's number). A byte from the caller, or its hanging up, before
then kills the child (the server kills it: the pid is still unreaped). The child is what the
interpreter would be: its own pid, environment, working directory and standard streams,
`OMP_NUM_THREADS` applied, non-daemon threads joined and atexit handlers run at its end
(`cli_child`); but what a module read from the environment as the server imported it stays
the server's (its environment is the first caller's, with `HF_HUB_OFFLINE=1`: every engines
test reads local folders). A test of that runs the interpreter itself (DFLASH_TESTS_FRESH_CLI=1)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import traceback

# What the server imports before it forks.
import torch
import transformers  # noqa: F401
import vllm  # noqa: F401
from vllm import LLM  # noqa: F401  (its engine's modules)

import dflash.cli
import dflash.engines.vllm
import dflash.eval.command  # noqa: F401
from tests.cli_child import _as_process, _exit_as_interpreter, python_main


def _child(argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> None:
    """The forked child's body: never returns (a failure before the program runs, e.g. a
    missing `cwd`: its traceback on the caller's stderr, status 1)."""
    redirected = False
    try:
        _as_process(env, cwd, *fds)
        redirected = True
        if env.get("OMP_NUM_THREADS", "").isdigit():  # as a new interpreter reads it
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        main = python_main(argv, cwd)
    except BaseException:
        if redirected:
            traceback.print_exc()
            sys.stderr.flush()
        else:  # the caller's stderr is not fd 2 yet
            os.write(fds[2], traceback.format_exc().encode())
        os._exit(1)
    _exit_as_interpreter(main)


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the caller hung up")
        data += chunk
    return data


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _start(listener: socket.socket, waiting: dict[int, socket.socket]) -> None:
    """One call: its request read (10 s at most), the child forked, its pid sent back. A caller
    that fails on the way costs its own call only."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        conn.settimeout(10.0)
        head, fds, _, _ = socket.recv_fds(conn, 4, 3)
        request = json.loads(_read(conn, struct.unpack("!I", head)[0]))
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in waiting.values():
                other.close()
            conn.close()
            _child(request["argv"], request["env"], request["cwd"], fds)
        waiting[pid] = conn  # reaped below, whatever becomes of its caller
        conn.sendall(struct.pack("!q", pid))
    except Exception:
        traceback.print_exc()  # to the server's log
        if conn not in waiting.values():
            conn.close()
    finally:
        for fd in fds:
            os.close(fd)


def _heard(conn: socket.socket, pid: int) -> None:
    """The caller wrote (a kill: it gave up) or hung up: the child killed, still unreaped here,
    so its pid cannot be another process's."""
    try:
        conn.recv(1)
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve(path: str) -> None:
    """Accept calls at `path` until stdin closes (the test worker has gone); single-threaded,
    so that every fork is of a process with one thread."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}  # child pid → its caller's connection
    while True:
        callers = {conn: pid for pid, conn in waiting.items()}
        ready, _, _ = select.select([listener, sys.stdin, *callers], [], [], 0.1)
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            for pid in waiting:
                os.kill(pid, signal.SIGKILL)
            return
        if listener in ready:
            _start(listener, waiting)
        for conn in ready:
            if conn in callers:
                _heard(conn, callers[conn])
        while waiting:
            pid, raw = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!i", _status(raw)))
                except OSError:  # the caller gave up on it
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
