"""Drafter replicas with known gradients and contributions for the reduce tests
(tests/test_devices.py), and the body of one rank of a real two-process gloo group over them
(a module-level function: the test forks each rank from the tests' server, which imports
this module to find it)."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch

from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.runtime.messages import StepGrads
from dflash.train.replicas import DrafterReplica

BLOCK = 4
SPEC = DrafterSpec(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64, vocab_size=128,
    rms_norm_eps=1e-6, rope_theta=1e4, target_layer_ids=[1], num_target_layers=4, block_size=BLOCK, mask_token_id=127,
    layer_types=["full_attention"], sliding_window=64,
)  # fmt: skip


def replicas(n: int) -> list[DrafterReplica]:
    """`n` CPU replicas of one small drafter, with the same weights (no head or optimizer:
    the reduce reads neither)."""
    torch.manual_seed(0)
    first = DFlashDrafter(SPEC)
    models = [first, *(DFlashDrafter(SPEC) for _ in range(n - 1))]
    for m in models[1:]:
        m.load_state_dict(first.state_dict())
    cpu = torch.device("cpu")
    return [DrafterReplica(i, cpu, m, None, None, None) for i, m in enumerate(models)]  # type: ignore[arg-type]


def grad(p: torch.Tensor, scale: float) -> torch.Tensor:
    """A gradient of small integers times `scale`: sums of a few are exact in float32."""
    return torch.arange(p.numel(), dtype=p.dtype).remainder(7).sub(3).reshape(p.shape) * scale


def fill_grads(rep: DrafterReplica, scale: float) -> None:
    for p in rep.params:
        p.grad = grad(p, scale)


def contribution(rep: DrafterReplica, k: int) -> StepGrads:
    """Replica `rep`'s StepGrads with sums that tell contributions apart (`k`: which one)."""
    return StepGrads(
        replica=rep.index, step=1, micro_batches=1, loss_sum=torch.tensor(10.0 * (k + 1)), weight_sum=3.0 + k,
        correct_per_slot=torch.arange(BLOCK, dtype=torch.float32) + k, count_per_slot=torch.full((BLOCK,), 2 + k),
        tokens=8, samples=2,
    )  # fmt: skip


def rank_main(rank: int, size: int, init: str, out: str) -> None:
    """One rank: two replicas; rank 0's both contribute (gradients scaled 1 and 2), the
    others' have nothing this step (their leftover gradients, scaled 100, must not count).
    `reduce_step` over a `World` of a real gloo group, then the step's host read; what came
    out is saved to `out`/rank{rank}.pt for the parent to compare."""
    import torch.distributed as dist

    from dflash.runtime.devices import Device
    from dflash.runtime.distributed import World
    from dflash.train.reduce import reduce_step

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timeout)
    world = World(rank, size, "gloo", timeout_s=60.0, bucket_mb=0.01)  # small buckets: several collectives
    device = Device("cpu", "optimizer")
    try:
        reps = replicas(2)
        if rank == 0:
            fill_grads(reps[0], 1.0)
            fill_grads(reps[1], 2.0)
            contribs = [contribution(reps[0], 0), contribution(reps[1], 1)]
        else:
            for r in reps:
                fill_grads(r, 100.0)
            contribs = []
        sums = reduce_step(device, reps, contribs, world, step=1)
        ok, weight = sums.read(torch.tensor(True))
        result = {
            "grads": sums.grads, "ok": ok, "weight": weight, "count": sums.count, "loss": sums.loss,
            "correct": sums.correct, "scale": sums.scale(), "buckets": len(list(world._buckets(sums.grads))),
        }  # fmt: skip
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        device.close()
        world.close(clean=True)


def rank_main_reporting(rank: int, size: int, init: str, out: str) -> None:
    """`rank_main`, its traceback written to `out`/rank{rank}.err on a failure (exit 1), for the
    parent to show: a forked rank's stderr is its server's."""
    import traceback

    try:
        rank_main(rank, size, init, out)
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
