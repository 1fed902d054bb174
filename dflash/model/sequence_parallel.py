"""Ulysses sequence parallelism for the drafter's attention (`pipeline.sequence_parallel = N`).

The N ranks of a group train one batch of rows together: rank r holds the context positions
`ctx_bounds[r]` of every row and the blocks `block_bounds[r]` (an equal share of the blocks,
not of the context: anchors cluster in the replies). Everything but attention is position-wise
or within a block (norms, MLP, DFlash2's convolutions, DSpark's heads, the loss), so it runs on
the rank's own share. Around each attention an all-to-all by heads gives every rank the whole
sequence — every context key and every block — for H/N heads; the rank attends with the whole
row's mask, and a second all-to-all gives each rank its own blocks' outputs for every head.
The result is the one-rank attention, head by head; the backward runs the exchanges in reverse.

KV heads fewer than N are repeated to N first (N a multiple of them): each rank then holds the
one KV head its query heads read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash.runtime.sequence import SequenceGroup

__all__ = ["SeqShard", "attach", "check_heads", "split_bounds"]


def split_bounds(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """[lo, hi) of each of `parts` near-equal shares of n items, in order."""
    return tuple((r * n // parts, (r + 1) * n // parts) for r in range(parts))


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> str | None:
    """Why heads cannot be split over `size` ranks, or None."""
    if num_heads % size:
        return f"the drafter's {num_heads} attention heads do not divide over {size} sequence-parallel ranks"
    if num_kv_heads % size and size % num_kv_heads:
        return (
            f"the drafter's {num_kv_heads} KV heads neither divide over {size} sequence-parallel ranks "
            "nor divide them (to be repeated)"
        )
    return None


class _AllToAll(torch.autograd.Function):
    """Split `x` along `dim` into `sizes`, send piece j to rank j; the pieces received, in rank
    order. Backward: the gradients of the pieces go back where they came from."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: SequenceGroup, rank: int, dim: int, sizes: list[int]) -> Any:
        got = group.exchange(rank, [c.contiguous() for c in x.split(sizes, dim=dim)])
        ctx.group, ctx.rank, ctx.dim = group, rank, dim
        ctx.shapes = [g.shape for g in got]
        ctx.like = x.new_empty(())  # the dtype and device of a gradient that did not come
        return tuple(got)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        full = [
            g.contiguous() if g is not None else ctx.like.new_zeros(s) for g, s in zip(grads, ctx.shapes, strict=True)
        ]
        back = ctx.group.exchange(ctx.rank, full)
        return torch.cat(back, dim=ctx.dim), None, None, None, None


def _all_to_all(x: torch.Tensor, group: SequenceGroup, rank: int, dim: int, sizes: list[int]) -> list[torch.Tensor]:
    return list(_AllToAll.apply(x, group, rank, dim, sizes))


class _Attach(torch.autograd.Function):
    """`loss` unchanged, with `x` in its graph: backward gives `x` a zero gradient."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.like = x.new_empty(()).expand(x.shape)  # the shape, dtype and device, no memory
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, torch.zeros_like(ctx.like)


def attach(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The loss with `x` (the drafter's output) in its graph, whatever slots this rank has: every
    rank of a group then runs every exchange of the backward (a rank without loss slots too)."""
    return _Attach.apply(loss, x)


@dataclass(frozen=True)
class SeqShard:
    """One rank's share of a batch, and its group."""

    group: SequenceGroup
    rank: int
    ctx_bounds: tuple[tuple[int, int], ...]  # each rank's context positions [lo, hi)
    block_bounds: tuple[tuple[int, int], ...]  # each rank's blocks [lo, hi)

    @property
    def size(self) -> int:
        return len(self.ctx_bounds)

    @property
    def ctx(self) -> tuple[int, int]:
        return self.ctx_bounds[self.rank]

    @property
    def blocks(self) -> tuple[int, int]:
        return self.block_bounds[self.rank]

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Any, mask: Any
    ) -> torch.Tensor:
        """`attend(q, k, v, mask)` over the whole row for this rank's heads, back to its queries:
        q (R, h, Q_r, d) and k/v (R, kvh, T_r + Q_r, d) (its context, then its blocks) in, the
        output (R, h, Q_r, d) out; `mask` is the whole row's."""
        N, group, rank = self.size, self.group, self.rank
        qs = _all_to_all(q, group, rank, 1, [q.shape[1] // N] * N)  # (R, h/N, Q_j, d) from each rank j
        kv = torch.stack([k, v])  # (2, R, kvh, T_r + Q_r, d)
        if kv.shape[2] < N:  # fewer KV heads than ranks: each rank gets the one its queries read
            kv = kv.repeat_interleave(N // kv.shape[2], dim=2)
        got = _all_to_all(kv, group, rank, 2, [kv.shape[2] // N] * N)
        sizes = [hi - lo for lo, hi in self.ctx_bounds]
        ctx = [g.narrow(3, 0, t) for g, t in zip(got, sizes, strict=True)]
        blocks = [g.narrow(3, t, g.shape[3] - t) for g, t in zip(got, sizes, strict=True)]
        kv = torch.cat(ctx + blocks, dim=3)  # every context position, then every block
        out = attend(torch.cat(qs, dim=2), kv[0], kv[1], mask)  # (R, h/N, Q, d)
        back = _all_to_all(out, group, rank, 2, [x.shape[2] for x in qs])
        return torch.cat(back, dim=1)
