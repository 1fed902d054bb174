"""Whether a drafter was trained for this target: its sizes must match the target's, or
its proposals would be read against the wrong vocabulary or layers. Refused in one line that
names both shapes and, where the drafter's run config is at hand (a checkpoint's
config.toml, or the run folder an export sits in), the config keys that differ from it.
`dflash eval` checks before the target loads when its sizes are known without loading it
(`TargetShape.from_config`), and again once loaded; a resume checks the checkpoint's spec
against the config's target before any model loads (`check_checkpoint_target`) and against
the run's own spec before its weights load (`check_checkpoint_fits`)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from dflash.config import Config, moved_keys_mapped
from dflash.errors import CheckpointError
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.target import TargetInfo, TargetShape

__all__ = ["check_checkpoint_fits", "check_checkpoint_target", "check_drafter_fits"]

_TARGET_KEYS = ("kind", "path", "layer_ids", "tiny")  # the keys that choose the target and its layers


def _problems(spec: DrafterSpec, shape: TargetShape) -> list[str]:
    problems = []
    if spec.hidden_size != shape.hidden_size:
        problems.append(f"hidden size {spec.hidden_size} vs target {shape.hidden_size}")
    if spec.vocab_size != shape.vocab_size:
        problems.append(f"vocab size {spec.vocab_size} vs target {shape.vocab_size}")
    if spec.num_target_layers != shape.num_layers:
        problems.append(f"trained on a {spec.num_target_layers}-layer target, this one has {shape.num_layers}")
    beyond = [i for i in spec.target_layer_ids if i >= shape.num_layers]
    if beyond and spec.num_target_layers == shape.num_layers:  # else said just above
        problems.append(f"reads target layers {beyond}, this one has {shape.num_layers}")
    return problems


def check_drafter_fits(
    drafter: DFlashDrafter,
    target: TargetInfo | TargetShape | None,
    where: Path | None = None,
    cfg: Config | None = None,
) -> None:
    """A drafter trained for another target must be refused, not silently evaluated.
    `target`: the loaded target, or its sizes from the config (None: not known yet, nothing
    checked). `where`, `cfg`: the drafter's folder and this config, to name the keys that
    differ from the drafter's run config."""
    if target is None:
        return
    shape = TargetShape.of(target) if isinstance(target, TargetInfo) else target
    spec = drafter.spec
    problems = _problems(spec, shape)
    if problems:
        keys = _differing_keys(_run_config(where), cfg) if where is not None and cfg is not None else []
        named = f"; config keys that differ from the drafter's run: {', '.join(keys)}" if keys else ""
        msg = (
            f"drafter {where or ''} does not fit this target: {'; '.join(problems)} (drafter made for "
            f"{TargetShape.of_drafter(spec)}, reading layers {spec.target_layer_ids}; this target: {shape}){named}"
        )
        raise CheckpointError(" ".join(msg.split()))


def _run_config(where: Path) -> dict[str, Any] | None:
    """The config the drafter's run trained with: a checkpoint's own config.toml, or that of
    the run folder an export was written into (`<run>/final`); None when neither is there."""
    for file in (where / "config.toml", where.parent / "config.toml"):
        if file.is_file() and (file.parent == where or (where.parent / "records.jsonl").is_file()):
            try:
                return moved_keys_mapped(tomllib.loads(file.read_text()))
            except (OSError, ValueError):
                return None
    return None


def _differing_keys(saved_config: dict[str, Any] | None, cfg: Config, drafter: bool = False) -> list[str]:
    """'target.tiny.hidden_size 64 -> 32' for each key that chooses the target (and with
    `drafter`, each [drafter] key) this config sets otherwise than the saved run config."""
    if not isinstance(saved_config, dict):
        return []
    now = cfg.model_dump(mode="json", exclude_none=True)
    keys = [("target", k) for k in _TARGET_KEYS] + [("drafter", k) for k in now["drafter"] if drafter]
    out = []
    for section, key in keys:
        a, b = (saved_config.get(section) or {}).get(key), now[section].get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{section}.{key}.{k} {a.get(k)!r} -> {b.get(k)!r}" for k in b if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{section}.{key} {a!r} -> {b!r}")
    return out


def _saved_spec(path: Path) -> DrafterSpec | None:
    """A checkpoint's drafter spec (its state.json); None for an older or unreadable one
    (the weights' own check in `restore` still runs)."""
    try:
        return DrafterSpec(**json.loads((path / "state.json").read_text())["spec"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _refuse(path: Path, what: str, saved: DrafterSpec, now: TargetShape, keys: list[str]) -> None:
    why = (
        f"config keys that differ: {', '.join(keys[:4])}"
        if keys
        else "no config key differs, so the target's own files differ from those it was trained with"
    )
    msg = f"{path}: its drafter does not fit this run: {what} (checkpoint made for {TargetShape.of_drafter(saved)}; "
    raise CheckpointError(f"{msg}this run's target: {now}); {why}")


def check_checkpoint_target(path: Path, cfg: Config) -> None:
    """Resuming, before any model loads: the target the checkpoint's drafter was made for
    must be this config's, as far as its sizes are known without loading it
    (`TargetShape.from_config`)."""
    saved, shape = _saved_spec(path), TargetShape.from_config(cfg.target)
    if saved is None or shape is None or TargetShape.of_drafter(saved) == shape:
        return
    keys = _differing_keys(_run_config(path), cfg)
    _refuse(path, "made for another target", saved, shape, keys)


def check_checkpoint_fits(path: Path, spec: DrafterSpec, saved_config: dict[str, Any], cfg: Config) -> None:
    """Resuming, once this run's drafter spec is made (from its target and `cfg`): the
    checkpoint's must be the same, checked before its weights are loaded, so a drafter for
    another target or shape is refused in one line, not by torch's list of tensor sizes."""
    saved = _saved_spec(path)
    differ = saved.differences(spec) if saved is not None else []
    if saved is not None and differ:
        keys = _differing_keys(saved_config, cfg, drafter=True)
        _refuse(path, f"{'; '.join(differ[:4])} (checkpoint vs this run)", saved, TargetShape.of_drafter(spec), keys)
