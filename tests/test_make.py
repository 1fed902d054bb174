"""The Makefile's plan for llama.cpp (`make -n`, nothing built): one build per machine in the
user's cache, each clone linked to it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

VERSION = re.search(r'^VERSION = "(.*)"', (ROOT / "dflash/serving/llamacpp.py").read_text(), re.M).group(1)


def _plan(clone: Path, cache: Path) -> str:
    env = {"PATH": os.environ["PATH"], "HOME": str(clone.parent)}
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", f"LLAMACPP_CACHE={cache}", f".llamacpp/{VERSION}/.server-built"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _clone(tmp_path: Path) -> Path:
    """What the Makefile reads, copied: make's plan in a scratch clone."""
    clone = tmp_path / "clone"
    for name in ("Makefile", "setup.py", "dflash/serving/llamacpp.py", "dflash/serving/llamacpp-build.cmake"):
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, clone / name)
    return clone


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_llamacpp_builds_once_per_machine_and_every_clone_links_to_it(tmp_path: Path):
    clone, cache = _clone(tmp_path), tmp_path / "cache"
    home = clone / ".llamacpp" / VERSION
    # Nothing built on the machine: the build goes into the cache, then the clone links to it.
    plan = _plan(clone, cache)
    shared = Path(re.search(rf"cmake --build ({re.escape(str(cache))}/{VERSION}-\d+)/build ", plan).group(1))
    assert f"ln -s {shared} .llamacpp/{VERSION}" in plan and plan.index("cmake --build") < plan.index("ln -s")
    # Built once (by another clone): only the link.
    (shared / "build" / "bin").mkdir(parents=True)
    (shared / ".server-built").touch()
    assert "cmake --build" in _plan(clone, cache)  # a stamp without its server: built again
    (shared / "build" / "bin" / "llama-server").touch()
    plan = _plan(clone, cache)
    assert "cmake --build" not in plan and f"ln -s {shared} .llamacpp/{VERSION}" in plan
    home.parent.mkdir(exist_ok=True)
    home.symlink_to(shared)
    assert "is up to date" in _plan(clone, cache)  # linked: nothing to do
    # A link to another key's build (another CPU under the same home, other build settings): remade.
    other = cache / f"{VERSION}-1"
    (other / "build" / "bin").mkdir(parents=True)
    (other / "build" / "bin" / "llama-server").touch()
    (other / ".server-built").touch()
    home.unlink()
    home.symlink_to(other)
    assert f"ln -s {shared} .llamacpp/{VERSION}" in _plan(clone, cache)
    # A build made inside the clone by an earlier set-up stays in use.
    home.unlink()
    (home / "build" / "bin").mkdir(parents=True)
    (home / "build" / "bin" / "llama-server").touch()
    (home / ".server-built").touch()
    assert "is up to date" in _plan(clone, cache)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_relative_llamacpp_cache_is_made_absolute(tmp_path: Path):
    """The clone's link is resolved from inside .llamacpp/: a relative cache would dangle."""
    clone = _clone(tmp_path)
    plan = _plan(clone, Path("rel"))
    assert f"ln -s {clone / 'rel'}/{VERSION}-" in plan
