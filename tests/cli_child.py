"""`bin/dflash ARGS` as the tests run it: a real process, forked from a server that has
imported torch, transformers and dflash once (multiprocessing's forkserver, one per test
worker), instead of a fresh interpreter that imports them again (~6 CPU-s a call, some
hundred calls a suite). The child is what `bin/dflash` would be: its own pid, exit status,
environment, working directory, stdin, stdout and stderr (files, or pipes: `Fd`), `PYTHONPATH` with the
checkout first, `dflash.cli.entry` as the program. What it cannot be is a process that
imports a module for the first time with its own environment: a test of that runs `bin/dflash`
itself (`conftest.dflash(..., fresh=True)`)."""

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
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, where, flags in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
        f = os.open(where, flags) if isinstance(where, str) else where
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # multiprocessing put /dev/null there  # noqa: SIM115
    sys.argv = ["dflash", *argv]
    code = 0
    try:
        dflash.cli.entry()
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
