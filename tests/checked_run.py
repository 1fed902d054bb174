"""Tiny runs of the real pipeline on checked devices (dflash/runtime/checked.py): virtual GPUs
over CPU tensors, every op checked for host syncs and races between streams."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dflash import Coordinator
from dflash.model.drafter import FrozenHead
from dflash.runtime.checked import Rules
from dflash.train.build import Training, build_training

# The checked runs' shape: few short samples, a few steps, metrics every 4 steps (a metrics
# sync every step would make the host wait for each update before the replicas go on, and
# hide a missing wait on the update).
SMALL = {
    "data.source": '"random"', "data.num_samples": 64, "data.gen_len": 24, "train.max_steps": 4,
    "train.log_every": 4, "eval.at_end": "false", "checkpoint.at_end": "false", "target.layer_ids": "[1, 2]",
}  # fmt: skip


def place(rules: Rules, training: Training, target_gpus: Sequence[int], replica_gpus: Sequence[int]) -> None:
    """Put set-up's weights on the virtual GPUs. A replica on another GPU than the target gets
    a frozen head of its own (on CPU, `.to()` shares the target's storage)."""
    for tgt, gpu in zip(training.targets, target_gpus, strict=True):
        rules.place(tgt.model, gpu)
    for rep, gpu in zip(training.replicas, replica_gpus, strict=True):
        if gpu != target_gpus[0]:
            embed = rep.head.embed.clone()
            rep.head = FrozenHead(embed, embed if rep.head.lm_head is rep.head.embed else rep.head.lm_head.clone())
        rules.place(rep.model, gpu)
        rules.place([rep.head.embed, rep.head.lm_head], gpu)
        if rep.loss_vocab is not None:
            rules.place([t for t in vars(rep.loss_vocab).values() if isinstance(t, torch.Tensor)], gpu)


def checked_run(
    make_config: Callable[..., Any],
    replica_gpus: Sequence[int] = (0,),
    drop: set[tuple[str, str]] = frozenset(),  # type: ignore[assignment]
    **overrides: object,
) -> tuple[list[dict[str, Any]], Rules]:
    """Train the tiny config with the target on virtual GPU 0 and one replica per entry of
    `replica_gpus`; the records and the checker. Raises the run's error (a `StageError`
    whose cause is a `CudaRuleError` when a rule is broken)."""
    devices = str(["cpu"] * len(replica_gpus)).replace("'", '"')
    cfg = make_config(**{**SMALL, "pipeline.drafter_devices": devices, **overrides})
    training = build_training(cfg)
    rules = Rules()
    rules.drop = set(drop)
    place(rules, training, [0], replica_gpus)
    gpus = {"target0": 0, **{f"drafter{i}": g for i, g in enumerate(replica_gpus)}}
    records: list[dict[str, Any]] = []
    coord = Coordinator(cfg, log=False, training=training, make_device=rules.factory(gpus))
    coord.subscribe(records.append)
    asyncio.run(asyncio.wait_for(coord.run(), 240))
    return records, rules


def cause(err: BaseException) -> str:
    """The message of the innermost cause of a run's error."""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"
