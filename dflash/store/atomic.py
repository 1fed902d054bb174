"""Atomic writes: the one way dflash puts a file or a folder in place.

`atomic_path(dest)` yields a temporary path beside `dest` (a file path, or with
`folder=True` an empty folder); when the block ends without an error everything written
there is fsynced, renamed onto `dest` (replacing what was there) and the parent folder is
fsynced, so a kill at any moment leaves either the old `dest` or the complete new one. On
an error the temporary path is removed and the error goes on. Checkpoints, exports, the
tokenization cache, converted models and profile traces all go through here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "fsync_path"]


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _new_file(dest: Path) -> Path:
    """An empty hidden file beside `dest`. Unlike mkstemp's 0600, its mode follows the umask,
    like a plain open(): the file that replaces `dest` is as readable as one written directly."""
    while True:
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp


@contextlib.contextmanager
def atomic_path(dest: str | Path, *, folder: bool = False, durable: bool = True) -> Iterator[Path]:
    """Write into the yielded temporary path; on success it becomes `dest` atomically.

    `folder`: yield a folder (every file in it is fsynced) instead of a file path.
    `durable=False` skips the fsyncs (caches and traces: atomic, but a power cut may lose them).
    The parent folder must exist.
    """
    dest = Path(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)) if folder else _new_file(dest)
    try:
        yield tmp
        if durable:
            for f in tmp.iterdir() if folder else [tmp]:
                fsync_path(f)
        if folder and dest.exists():
            # A folder cannot be renamed over a non-empty one: move the old one aside first.
            old = dest.with_name(f".{dest.name}.old")
            _remove(old)
            dest.rename(old)
            tmp.rename(dest)
            _remove(old)
        else:
            os.replace(tmp, dest)
        if durable:
            fsync_path(dest.parent)
    except BaseException:
        _remove(tmp)
        raise
