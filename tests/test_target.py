"""Targets from a local Hugging Face folder, layer capture, and mask-token validation."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash import ConfigError, Coordinator
from dflash.config import TinyTargetConfig
from dflash.model.drafter import default_target_layers
from dflash.model.target import Target, build_tiny
from tests.conftest import run_records


def test_default_target_layers_follow_dflash_rule():
    """One draft layer reads L//2; n layers read round(1 + i(L-4)/(n-1)) (Qwen3-8B: 1,9,17,25,33)."""
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layers(30, 1) == [15]


def test_capture_equals_hidden_states_offset_by_one():
    """Captured layer i equals HF hidden_states[i + 1] (the output of decoder layer i)."""
    model = build_tiny(TinyTargetConfig(num_layers=4))
    t = Target(model, [0, 2])
    ids = torch.randint(0, 500, (2, 7))
    got = t.capture(ids, torch.zeros_like(ids), torch.arange(7).expand(2, 7))
    hs = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(got[0], hs[1])
    torch.testing.assert_close(got[1], hs[3])
    # plain forwards are untouched by the capture hooks
    assert model(ids).logits.shape == (2, 7, 512)


def test_hf_folder_target_trains(tiny_config, tmp_path):
    """target.kind = 'hf' loads a local model folder (here: the tiny model saved to disk)."""
    folder = tmp_path / "model"
    build_tiny(TinyTargetConfig()).save_pretrained(folder)
    cfg = tiny_config(
        **{"target.kind": '"hf"', "target.path": f'"{folder}"', "drafter.mask_token_id": 511,
           "train.max_steps": 2, "eval.at_end": "false"}
    )  # fmt: skip
    coord = Coordinator(cfg, log=False)
    summary = asyncio.run(coord.run())
    assert summary["steps"] == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"target.kind": '"hf"', "target.path": '"/nonexistent/model"'}, "is not a folder"),
        ({"drafter.mask_token_id": 100000}, "outside the target's embedding"),
        ({"target.layer_ids": "[9]"}, "out of range"),
        ({"pipeline.drafter_devices": '["cuda:0"]'}, "CUDA is not available"),
        ({"drafter.attention": '"flex"'}, "no backward on CPU"),
    ],
)
def test_bad_setup_is_a_config_error(tiny_config, overrides, message):
    """Set-up problems are ConfigErrors that say what is wrong, before any training."""
    if "cuda" in str(overrides) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=message):
        asyncio.run(Coordinator(tiny_config(**overrides), log=False).run())


def test_hf_folder_without_mask_token_is_refused(tiny_config, tmp_path):
    """A real target needs an explicit drafter.mask_token_id."""
    folder = tmp_path / "model"
    build_tiny(TinyTargetConfig()).save_pretrained(folder)
    cfg = tiny_config(**{"target.kind": '"hf"', "target.path": f'"{folder}"'})
    with pytest.raises(ConfigError, match="mask_token_id: required"):
        asyncio.run(Coordinator(cfg, log=False).run())


def test_near_zero_mask_row_warns(tiny_config, tmp_path):
    """A mask token whose embedding row is ~0 (SGLang #27924) gives a warning record."""
    folder = tmp_path / "model"
    model = build_tiny(TinyTargetConfig())
    with torch.no_grad():
        model.get_input_embeddings().weight[7].zero_()
    model.save_pretrained(folder)
    cfg = tiny_config(
        **{"target.kind": '"hf"', "target.path": f'"{folder}"', "drafter.mask_token_id": 7,
           "train.max_steps": 1, "eval.at_end": "false"}
    )  # fmt: skip
    records = run_records(cfg)
    warnings = [r["message"] for r in records if r["event"] == "warning"]
    assert any("near zero" in w for w in warnings), warnings


def test_packed_row_features_equal_separate_documents():
    """A packed row (two documents + padding) gives each document the features it has alone."""
    model = build_tiny(TinyTargetConfig(num_layers=3))
    t = Target(model, [1])
    a, b = torch.randint(0, 500, (5,)), torch.randint(0, 500, (4,))
    ids = torch.cat([a, b, torch.zeros(2, dtype=torch.long)])[None]
    doc = torch.tensor([[3] * 5 + [8] * 4 + [-1] * 2])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0]])
    (packed,) = t.capture(ids, doc, pos)
    (alone_a,) = t.capture(a[None], torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None])
    (alone_b,) = t.capture(b[None], torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None])
    torch.testing.assert_close(packed[0, :5], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[0, 5:9], alone_b[0], atol=1e-5, rtol=1e-5)


def test_distillation_reads_the_targets_prediction_for_each_label(tiny_config):
    """`loss.distill`: the target's top-k travels with the features, and for slot k of a
    block at anchor a the drafter gets the target's prediction made at position a + k − 1.
    On self-distilled data (the target's own greedy replies) its top-1 is the label itself."""
    import math

    from dflash.runtime.devices import Device
    from dflash.runtime.messages import HostFeatures
    from dflash.stages import drafter_step, target_forward
    from dflash.stages.prefetch import next_batch
    from dflash.train.build import build_training

    cfg = tiny_config(**{"loss.distill": 0.5, "loss.distill_topk": 4, "data.num_samples": 16})
    t = build_training(cfg)
    batch = next_batch(iter(t.plan), False)
    layers, teacher = target_forward.forward(t.targets[0], batch, t.targets[0].teacher_topk)
    assert teacher is not None and teacher[0].shape == (*batch.input_ids.shape, 4)
    assert torch.equal(torch.cat(layers, -1), torch.cat(t.targets[0].capture(
        batch.input_ids, batch.doc_ids, batch.positions, batch.packed), -1))  # fmt: skip
    feats = HostFeatures(batch, torch.cat(layers, -1), 0, teacher=teacher)
    dev = Device("cpu", "d")
    p = asyncio.run(drafter_step.prepare(t.replicas[0], t.micro, dev, feats, 0)).batch
    dev.close()
    vals, ids = p.targets.teacher
    assert ids.shape == (p.targets.labels.shape[0], 4) and bool((vals[:, 0] >= vals[:, 1]).all())
    assert torch.equal(ids[:, 0], p.targets.labels)  # greedy replies: the target's top-1 is the label
    records = run_records(tiny_config(**{"loss.distill": 0.5, "train.max_steps": 3, "eval.at_end": "false"}))
    losses = [r["loss"] for r in records if r["event"] == "train_step"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # The feature cache keeps the top-k beside the features: cached epochs distill too.
    cached = tiny_config(**{"loss.distill": 0.5, "train.epochs": 3, "data.feature_cache_mb": 8,
                            "eval.at_end": "false"})  # fmt: skip
    records = run_records(cached)
    losses = [r["loss"] for r in records if r["event"] == "train_step"]
    assert records[-1]["feature_cache"]["hits"] > 0 and all(math.isfinite(x) for x in losses)


def _prepared_first_batch(cfg: Any) -> tuple[Any, Any]:
    """The first batch of a run and what the drafter step prepares from it (features and
    top-k straight from the target)."""
    from dflash.runtime.devices import Device
    from dflash.runtime.messages import HostFeatures
    from dflash.stages import drafter_step, target_forward
    from dflash.stages.prefetch import next_batch
    from dflash.train.build import build_training

    t = build_training(cfg)
    batch = next_batch(iter(t.plan), False)
    layers, teacher = target_forward.forward(t.targets[0], batch, t.targets[0].teacher_topk)
    feats = HostFeatures(batch, torch.cat(layers, -1), 0, teacher=teacher)
    dev = Device("cpu", "d")
    try:
        return batch, asyncio.run(drafter_step.prepare(t.replicas[0], t.micro, dev, feats, 0)).batch
    finally:
        dev.close()


def test_target_labels_are_the_targets_greedy_tokens(tiny_config):
    """`loss.labels = "target"`: slot k of the block at anchor a learns the target's argmax at
    position a + k − 1 — on any text, not only the target's own replies. On random token ids
    these differ from the data's tokens; on self-distilled data they are the same, and so is
    the whole run's loss."""
    from dflash.model.loss import block_targets
    from dflash.train.build import build_training

    cfg = tiny_config(**{"loss.labels": '"target"', "data.source": '"random"', "data.num_samples": 16})
    batch, p = _prepared_first_batch(cfg)
    with torch.no_grad():
        logits = build_training(cfg).targets[0].model(input_ids=batch.input_ids, position_ids=batch.positions).logits
    greedy = logits.argmax(-1)  # (R, T): the target's next token after each position
    B, R = cfg.drafter.block_size, batch.input_ids.shape[0]
    anchors, valid = _anchors(batch, cfg)
    data = block_targets(batch.input_ids, batch.loss_mask, batch.doc_ids, anchors, valid, B, 1.0)
    where = (anchors[:, :, None] + torch.arange(B) - 1).clamp(0, greedy.shape[1] - 1).reshape(R, -1)
    expected = torch.gather(greedy, 1, where).reshape(-1)[data.sel]
    assert torch.equal(p.targets.labels, expected)
    assert not torch.equal(p.targets.labels, data.labels)  # random ids: the target disagrees with them

    def losses(labels: str) -> list[float]:
        c = tiny_config(**{"loss.labels": f'"{labels}"', "train.max_steps": 4, "eval.at_end": "false"})
        return [r["loss"] for r in run_records(c) if r["event"] == "train_step"]

    assert losses("target") == losses("data")  # the target's greedy replies: the same labels


def test_greedy_prefix_only_keeps_later_slots_after_greedy_data_tokens(tiny_config):
    """`loss.greedy_prefix_only`: slot k >= 2 keeps its weight only where the data's tokens at
    slots 1..k-1 of its block are the target's greedy tokens; slot 1 always keeps it. On the
    target's own greedy replies later slots keep theirs; on random ids they lose them."""
    from dflash.model.loss import block_targets, gamma_weights
    from dflash.train.build import build_training

    kept = {}
    for source in ("random", "synthetic"):
        over = {"loss.labels": '"target"', "data.source": f'"{source}"', "data.num_samples": 16}
        cfg = tiny_config(**over, **{"loss.greedy_prefix_only": "true"})
        batch, p = _prepared_first_batch(cfg)
        with torch.no_grad():
            target = build_training(cfg).targets[0].model
            logits = target(input_ids=batch.input_ids, position_ids=batch.positions).logits
        greedy, ids = logits.argmax(-1), batch.input_ids
        B, gamma = cfg.drafter.block_size, cfg.drafter.resolved_gamma
        anchors, valid = _anchors(batch, cfg)
        data = block_targets(ids, batch.loss_mask, batch.doc_ids, anchors, valid, B, gamma)
        expected = []
        for flat in data.sel.tolist():
            r, rest = divmod(flat, anchors.shape[1] * B)
            n, k = divmod(rest, B)
            a = int(anchors[r, n])
            ok = all(int(ids[r, a + j]) == int(greedy[r, a + j - 1]) for j in range(1, k))
            expected.append(float(gamma_weights(B, gamma)[k]) * ok)
        assert torch.allclose(p.targets.weights, torch.tensor(expected))
        assert bool((p.targets.weights[data.slot == 1] > 0).all())
        later = data.slot >= 2
        kept[source] = float((p.targets.weights[later] > 0).float().mean())
    assert kept["random"] < 0.05 and kept["synthetic"] > 0.5, kept
    with pytest.raises(ConfigError, match="greedy_prefix_only"):
        tiny_config(**{"loss.greedy_prefix_only": "true"})


def _anchors(batch: Any, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    from dflash.model.anchors import sample_anchors

    return sample_anchors(batch.loss_mask, batch.doc_ids, cfg.drafter.max_anchors, seed=cfg.run.seed, epoch=batch.epoch)


def test_bf16_target_with_a_cpu_drafter_trains(tiny_config):
    """`target.dtype = "bfloat16"` on a CPU (fast on CPUs with AVX512-BF16): the drafter keeps
    fp32 weights and computes under CPU bf16 autocast, as on CUDA; eval stays lossless."""
    import math

    from dflash.model.target import load_target
    from dflash.train.build import eval_target

    bf16 = {"target.dtype": '"bfloat16"', "train.max_steps": 4, "eval.num_prompts": 2}
    records = run_records(tiny_config(**bf16, **{"eval.target_dtype": '"float32"'}))
    losses = [r["loss"] for r in records if r["event"] == "train_step"]
    evals = [r for r in records if r["event"] == "eval"]
    assert losses and all(math.isfinite(x) for x in losses)
    assert evals and evals[-1]["lossless"] is True
    # eval.target_dtype: eval gets its own float32 copy of the target, same layers; "same" keeps it
    cfg = tiny_config(**bf16, **{"eval.target_dtype": '"float32"'})
    target = load_target(cfg.target, torch.device("cpu"), cfg.drafter.num_layers)
    assert target.embed_weight.dtype == torch.bfloat16
    fp32 = eval_target(cfg, target)
    assert fp32.embed_weight.dtype == torch.float32 and fp32.layer_ids == target.layer_ids
    assert eval_target(tiny_config(**bf16), target) is target


def test_fastest_dtype_is_bf16_on_a_cpu_only_where_bf16_is_fast(monkeypatch):
    """`target.dtype = "fastest"`: bfloat16 on CUDA; on a CPU bfloat16 only where it measures
    clearly faster than float32 (emulated bf16 is several times slower); DFLASH_CPU_BF16
    overrides the measurement; "auto" is unchanged (float32 on a CPU)."""
    from dflash.model import target as tmod

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tmod.resolve_dtype("fastest", cuda) == torch.bfloat16
    try:
        for forced, want in (("1", torch.bfloat16), ("0", torch.float32)):
            monkeypatch.setenv("DFLASH_CPU_BF16", forced)
            tmod.cpu_bf16_is_fast.cache_clear()
            assert tmod.resolve_dtype("fastest", cpu) == want
            assert tmod.resolve_dtype("auto", cpu) == torch.float32
        monkeypatch.setenv("DFLASH_CPU_BF16", "yes")
        tmod.cpu_bf16_is_fast.cache_clear()
        with pytest.raises(ConfigError, match="DFLASH_CPU_BF16: expected 0 or 1"):
            tmod.resolve_dtype("fastest", cpu)
        monkeypatch.delenv("DFLASH_CPU_BF16")
        tmod.cpu_bf16_is_fast.cache_clear()
        # The measurement: bf16 counts as fast only when its matmul beats float32's by 20 %.
        # A fake clock moves by each fake matmul's cost, so the figures are exact.
        clock = SimpleNamespace(t=0.0, perf_counter=lambda: clock.t)
        cost: dict[torch.dtype, float] = {}
        calls = []

        def fake_linear(x, w):
            calls.append(x.dtype)
            clock.t += cost[x.dtype]

        monkeypatch.setattr(tmod, "time", clock)
        monkeypatch.setattr(torch.nn.functional, "linear", fake_linear)
        for bf16, fast in ((4.0, False), (0.85, False), (0.75, True)):  # bf16's time over float32's
            cost.update({torch.float32: 0.001, torch.bfloat16: 0.001 * bf16})
            tmod.cpu_bf16_is_fast.cache_clear()
            want = torch.bfloat16 if fast else torch.float32
            assert tmod.cpu_bf16_is_fast() is fast and tmod.resolve_dtype("fastest", cpu) == want, bf16
        assert calls.count(torch.bfloat16) == calls.count(torch.float32) == 7 * 3
    finally:
        tmod.cpu_bf16_is_fast.cache_clear()
