"""Whether a drafter was trained for this target: its sizes must match the target's, or
its proposals would be read against the wrong vocabulary or layers."""

from __future__ import annotations

from dflash.errors import CheckpointError
from dflash.model.drafter import DFlashDrafter
from dflash.model.target import Target

__all__ = ["check_drafter_fits"]


def check_drafter_fits(drafter: DFlashDrafter, target: Target) -> None:
    """A drafter trained for another target must be refused, not silently evaluated."""
    spec = drafter.spec
    problems = []
    if spec.hidden_size != target.hidden_size:
        problems.append(f"hidden size {spec.hidden_size} vs target {target.hidden_size}")
    if spec.vocab_size != target.vocab_size:
        problems.append(f"vocab size {spec.vocab_size} vs target {target.vocab_size}")
    if spec.num_target_layers != target.num_layers:
        problems.append(f"trained on a {spec.num_target_layers}-layer target, this one has {target.num_layers}")
    if problems:
        msg = "drafter does not fit this target: " + "; ".join(problems)
        raise CheckpointError(msg)
