"""FLOPs per stage (dflash/roofline/flops.py) against torch's FlopCounterMode, on the tiny
model and the demo's shapes (SmolLM2-135M's config, random weights): within 5 %."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dflash.roofline import flops


def _counted(fn) -> float:  # type: ignore[no-untyped-def]
    # The math kernel: matmuls FlopCounterMode sees (the CPU's fused attention kernel is not in its table).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def _one_batch(training):  # type: ignore[no-untyped-def]
    from dflash.runtime.devices import Device
    from dflash.runtime.messages import HostFeatures
    from dflash.stages.prefetch import next_batch

    batch = next_batch(iter(training.plan), pin=False)
    target, rep = training.targets[0], training.replicas[0]
    dev = Device("cpu", "drafter0")
    return batch, target, rep, dev, HostFeatures


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
@pytest.mark.parametrize("labels", ["data", "target"])
def test_stage_flops_match_flop_counter_mode_on_the_tiny_model(tiny_config, family, labels):
    from dflash.train.build import build_training

    cfg = tiny_config(**{"drafter.family": f'"{family}"', "loss.labels": f'"{labels}"', "loss.chunk": 64,
                         "eval.at_end": "false"})  # fmt: skip
    training = build_training(cfg)
    batch, target, rep, dev, HostFeatures = _one_batch(training)
    teacher = training.micro.loss.teacher_topk
    out: list = []
    counted_target = _counted(lambda: out.append(target.of_batch(batch, teacher)))
    layers, taught = out[0]
    shape = flops.DecoderShape.of_hf(target.model.config)
    R, T = batch.input_ids.shape
    ours = flops.target_forward(shape, R, T, max(target.layer_ids) + 1, teacher=bool(teacher))
    assert ours == pytest.approx(counted_target, rel=0.05)

    feats = HostFeatures(batch, torch.cat(layers, dim=-1), 0, teacher=taught)
    prepared = training.micro.prepare(rep, dev, feats, 0)
    fwd_bwd = _counted(lambda: training.micro.compute(rep, dev, prepared))
    ours = flops.of_prepared(rep, prepared, training.micro.loss.chunk)
    assert ours.total == pytest.approx(fwd_bwd, rel=0.05), (ours, fwd_bwd)


@pytest.mark.slow
def test_stage_flops_match_flop_counter_mode_on_the_demo_model(tmp_path):
    """The demo's recipe (DSpark drafter, vocab = "data" with sampled negatives, target labels,
    layer 27 captured) on a random target of SmolLM2-135M's sizes (its package is `make demo`'s,
    not the tests'), random data."""
    from dflash.config import load_config
    from dflash.train.build import build_training
    from tests.conftest import ROOT

    sets = ['data.source="random"', "data.num_samples=16", "data.gen_len=96", 'target.dtype="float32"',
            "eval.at_end=false", f'run.output_dir="{tmp_path}"', "drafter.init_from_target=false",
            "train.max_minutes=0", 'target.kind="tiny"', "target.tiny.vocab_size=49152", "target.tiny.hidden_size=576",
            "target.tiny.num_layers=30", "target.tiny.num_heads=9", "target.tiny.num_kv_heads=3",
            "target.tiny.head_dim=64", "target.tiny.intermediate_size=1536"]  # fmt: skip
    training = build_training(load_config(ROOT / "configs" / "demo.toml", sets))
    batch, target, rep, dev, HostFeatures = _one_batch(training)
    teacher = training.micro.loss.teacher_topk
    out: list = []
    counted_target = _counted(lambda: out.append(target.of_batch(batch, teacher)))
    shape = flops.DecoderShape.of_hf(target.model.config)
    R, T = batch.input_ids.shape
    ours = flops.target_forward(shape, R, T, max(target.layer_ids) + 1, teacher=bool(teacher))
    assert ours == pytest.approx(counted_target, rel=0.05)
    layers, taught = out[0]
    prepared = training.micro.prepare(rep, dev, HostFeatures(batch, torch.cat(layers, dim=-1), 0, teacher=taught), 0)
    fwd_bwd = _counted(lambda: training.micro.compute(rep, dev, prepared))
    assert flops.of_prepared(rep, prepared, training.micro.loss.chunk).total == pytest.approx(fwd_bwd, rel=0.05)
