"""Fault injection for tests and drills: make one stage raise at its n-th item.

    DFLASH_INJECT_FAULT="target.model_forward@3" bin/dflash run configs/tiny.toml

Read when a Coordinator starts a run. Costs one dict lookup per stage call when unset.
"""

from __future__ import annotations

import os

__all__ = ["InjectedFault", "check", "configure"]

_plan: dict[str, int] = {}
_seen: dict[str, int] = {}
_from: set[str] = set()


class InjectedFault(RuntimeError):
    """The exception an injected fault raises."""


def configure(spec: str | None = None) -> None:
    """`stage@n[,stage@n...]`; None reads DFLASH_INJECT_FAULT."""
    spec = os.environ.get("DFLASH_INJECT_FAULT", "") if spec is None else spec
    _plan.clear()
    _seen.clear()
    _from.clear()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, _, n = part.partition("@")
        if n.endswith("+"):
            _from.add(stage)
            n = n[:-1]
        _plan[stage] = int(n or 0)


def poison(name: str) -> bool:
    """True on the planned call(s) of `name` (`name@n`, or `name@n+` for every call from n)."""
    if name not in _plan:
        return False
    n = _seen.get(name, 0)
    _seen[name] = n + 1
    return n == _plan[name] or (name in _from and n >= _plan[name])


def check(stage: str) -> None:
    """Raise InjectedFault on the planned call of `stage` (counted from 0)."""
    if stage not in _plan:
        return
    n = _seen.get(stage, 0)
    _seen[stage] = n + 1
    if n == _plan[stage]:
        msg = f"injected fault in {stage} at call {n}"
        raise InjectedFault(msg)
