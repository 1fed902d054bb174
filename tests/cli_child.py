"""`bin/dflash ARGS` as the tests run it: a real process, forked from a server that has
imported torch, transformers and dflash once (multiprocessing's forkserver, one per test
worker), instead of a fresh interpreter that imports them again (~6 CPU-s a call, some
hundred calls a suite). The child is what `bin/dflash` would be: its own pid, exit status,
environment, working directory, stdin, stdout and stderr (files, or pipes: `Fd`), `PYTHONPATH` with the
checkout first, `dflash.cli.entry` as the program. What it cannot be is a process that
imports a module for the first time with its own environment: a test of that runs `bin/dflash`
itself (`conftest.dflash(..., fresh=True)`). `run_code` is `python -c CODE ARGS` forked the
same way, `run_script` `python SCRIPT ARGS`."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from typing import Any

# What the server imports before it forks (set_forkserver_preload imports this module).
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

import dflash.cli
import dflash.eval.command
import dflash.pipeline.coordinator
import dflash.train.build


class Fd:
    """A file descriptor of the parent's handed to the child as its own (a pipe's end):
    multiprocessing sends it over the forkserver's socket; the child's argument is the int."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


def run_cli(
    argv: list[str], env: dict[str, str], cwd: str, stdin: str | int, stdout: str | int, stderr: str | int
) -> None:
    """The child's body: `dflash ARGV`, its standard streams from and to these files (a path)
    or pipes (a descriptor, `Fd` in the parent); exits with the CLI's status as an interpreter
    would: its non-daemon threads joined, then its atexit handlers run."""
    _as_process(env, cwd, stdin, stdout, stderr)
    sys.argv = ["dflash", *argv]
    _exit_as_interpreter(dflash.cli.entry)


def run_code(
    argv: list[str], env: dict[str, str], cwd: str, stdin: str | int, stdout: str | int, stderr: str | int
) -> None:
    """`python -c CODE ARGS` as `run_cli` runs `dflash`: ARGV is [CODE, *ARGS]; the code runs
    as `__main__` with sys.argv ["-c", *ARGS], and the child exits as an interpreter would."""
    _as_process(env, cwd, stdin, stdout, stderr)
    code, *args = argv
    sys.argv = ["-c", *args]
    _exit_as_interpreter(lambda: exec(compile(code, "<string>", "exec"), {"__name__": "__main__"}))


def run_script(
    argv: list[str], env: dict[str, str], cwd: str, stdin: str | int, stdout: str | int, stderr: str | int
) -> None:
    """`python SCRIPT ARGS` as `run_cli` runs `dflash`: ARGV is [SCRIPT, *ARGS]; the script runs
    as `__main__` with sys.argv [SCRIPT, *ARGS] and its folder first on sys.path."""
    _as_process(env, cwd, stdin, stdout, stderr)
    _exit_as_interpreter(python_main(argv, cwd))


def python_main(argv: list[str], cwd: str) -> Any:
    """What `python ARGV` runs, `-m MODULE ARGS` or `SCRIPT ARGS`, with `sys.argv` and the
    first entry of `sys.path` (the working directory, or the script's folder) as the
    interpreter sets them."""
    import runpy

    if argv[0] == "-m":
        module, *args = argv[1:]
        sys.argv = [module, *args]
        sys.path.insert(0, cwd)
        return lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    return lambda: runpy.run_path(argv[0], run_name="__main__")


def _as_process(env: dict[str, str], cwd: str, stdin: str | int, stdout: str | int, stderr: str | int) -> None:
    """The environment, working directory and standard streams of the process the child stands for."""
    import tempfile

    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from TMPDIR, as a new interpreter finds it
    os.chdir(cwd)
    for fd, where, flags in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
        f = os.open(where, flags) if isinstance(where, str) else where
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # multiprocessing put /dev/null there  # noqa: SIM115


def _exit_as_interpreter(main: Any) -> None:
    """Run `main`, then exit with its status as an interpreter would: a SystemExit's code (a
    string printed to stderr, status 1), a traceback and status 1 for any other exception;
    non-daemon threads joined, then the atexit handlers run."""
    code = 0
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            code = 1
        else:
            code = e.code or 0
    except BaseException:  # as an interpreter would: the traceback, status 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
