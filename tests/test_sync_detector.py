"""The sync detector (dflash/runtime/checked.py) sees inside libraries: over tiny runs of every
target kind, packed and unpacked, with target labels and distillation on and off, in the
pipeline and the serial loop, no stage makes the host wait for a GPU outside a named sync —
in our code, in transformers, in the loss. A planted `.item()`, or the target forward's plain
call into transformers (which tests the positions on the host), fails the run naming the op
and the Python frame that issued it. `tests/test_host_syncs.py` stays the quick lint of our
own source."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checked_run import checked_run

from dflash.config import TinyTargetConfig
from dflash.errors import StageError
from dflash.model.target import Target, build_tiny
from dflash.stages import pack


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Qwen3 saved as a Hugging Face folder (`target.kind = "hf"`), and a Llama of
    the same size: the architecture a GGUF target (SmolLM2) is loaded as after conversion."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("targets")
    build_tiny(TinyTargetConfig()).save_pretrained(root / "qwen3")
    t = TinyTargetConfig()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
            head_dim=t.head_dim, tie_word_embeddings=True,
        )
    )  # fmt: skip
    llama.save_pretrained(root / "llama")
    from transformers import AutoTokenizer  # the tiny Qwen3 folder's (there, transformers' default)

    AutoTokenizer.from_pretrained(root / "qwen3").save_pretrained(root / "llama")
    return {"qwen3": root / "qwen3", "llama": root / "llama"}


TARGET_LABELS = {"loss.labels": '"target"', "loss.greedy_prefix_only": "true"}
DISTILL = {"loss.distill": 0.5, "loss.distill_topk": 8}
SERIAL = {"pipeline.mode": '"serial"'}
HOOKS = {  # eval and checkpoints between steps: their device reads are named, nothing else
    "eval.every_steps": 2, "eval.num_prompts": 2, "eval.max_new_tokens": 8, "checkpoint.every_steps": 2,
}  # fmt: skip
CACHE = {"data.feature_cache_mb": 64, "data.num_samples": 32, "train.epochs": 3}  # steps 3 and 4 skip the target
PACKED = {"data.pack": "true", "data.max_seq_len": 96, "data.num_samples": 128}  # two or three documents a row

# A covering set, not the whole product: each kind, packing, labels, distillation and mode
# appears both ways.
MATRIX = {
    "tiny-unpacked-pipeline-hooks": ("tiny", HOOKS),
    "tiny-packed-labels-distill-2gpus": ("tiny", {**PACKED, **TARGET_LABELS, **DISTILL}),
    "tiny-packed-serial": ("tiny", {**PACKED, **SERIAL}),
    "tiny-cache-hits-2gpus": ("tiny", CACHE),
    "hf-unpacked-distill": ("qwen3", DISTILL),
    "llama-unpacked-labels": ("llama", TARGET_LABELS),
    "llama-packed-serial-distill": ("llama", {**PACKED, **SERIAL, **DISTILL}),
}


def _target(kind: str, folders: dict[str, Path]) -> dict[str, object]:
    if kind == "tiny":
        return {}
    return {"target.kind": '"hf"', "target.path": f'"{folders[kind]}"', "drafter.mask_token_id": 511}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MATRIX))
def test_no_stage_syncs_the_host_outside_a_named_sync(tiny_config, model_folders, case):
    kind, extra = MATRIX[case]
    gpus = (0, 1) if case.endswith("2gpus") else (0,)
    records, rules = checked_run(tiny_config, gpus, **_target(kind, model_folders), **extra)
    assert [r["step"] for r in records if r["event"] == "train_step"] == [1, 2, 3, 4]
    assert rules.ops > 500
    if extra is CACHE:  # later epochs' batches came from the cache, through the device's pinned buffers
        assert "target0/target.feature_cache_hit@gpu0" in rules.stream_names


PLANTS = {  # a host read of a device value, planted in the pack stage, and what the failure names
    "item": (lambda t: t.sum().item(), "aten._local_scalar_dense"),
    "bool": (lambda t: bool(t.sum() > 0), "aten._local_scalar_dense"),
    "tolist": (lambda t: t[0, 0, :2].tolist(), "Tensor.tolist"),
    "mask_index": (lambda t: t[t > 0], "with a boolean mask"),
    "nonzero": (lambda t: t.nonzero(), "aten.nonzero"),
    "made_on_device": (lambda t: torch.ones(3, device=t.device).nonzero(), "aten.nonzero"),  # a factory given a device
    "to_cpu": (lambda t: t.to("cpu"), "Tensor.to"),
    "repeat_interleave": (lambda t: torch.arange(2).repeat_interleave(t[0, 0, :2].long().abs()), "without output_size"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_sync_in_a_stage_fails_naming_op_and_frame(tiny_config, monkeypatch, plant):
    real, (peek, named) = pack.pack, PLANTS[plant]

    def pack_and_peek(layers):  # type: ignore[no-untyped-def]
        out = real(layers)
        peek(out)
        return out

    monkeypatch.setattr(pack, "pack", pack_and_peek)
    with pytest.raises(StageError) as err:
        checked_run(tiny_config, **{"train.max_steps": 1})
    msg = str(err.value)
    assert msg.startswith("stage target.pack_hidden[0] failed: CudaRuleError: target0 target.pack_hidden: sync:"), msg
    assert named in msg and "test_sync_detector.py" in msg, msg


def test_the_plain_call_into_transformers_fails_inside_transformers(tiny_config, monkeypatch):
    """With no mask and no cache, transformers' own mask preparation tests the positions for
    packed sequences with a Python bool of a device tensor; the target forward avoids it
    (`target.training_view`). Calling the model itself brings the sync back."""

    def plain(self, input_ids, doc_ids, position_ids, packed):  # type: ignore[no-untyped-def]
        base = getattr(self.model, "model", self.model)
        return base(input_ids=input_ids, position_ids=position_ids, use_cache=False)

    monkeypatch.setattr(Target, "_base_forward", plain)
    with pytest.raises(StageError) as err:
        checked_run(tiny_config)
    msg = str(err.value)
    assert "target.model_forward" in msg and "sync: aten." in msg
    assert "transformers/masking_utils.py" in msg, msg


def test_the_sync_check_stays_armed_while_hooks_await(monkeypatch):
    """Torch's sync debug mode is process-wide: a hook must not turn it off for the whole of
    its await (other stages run meanwhile), only around its own device reads (`ctx.read`)."""
    import asyncio

    from dflash.runtime import devices
    from dflash.runtime.profiler import Profiler
    from dflash.train.hooks import StepBook, StepResult

    monkeypatch.setattr(devices, "_set_mode", lambda mode: None)
    seen: list[int] = []

    class Hook:
        async def after_step(self, ctx):  # type: ignore[no-untyped-def]
            seen.append(devices._named_syncs)
            await ctx.read(None, lambda: seen.append(devices._named_syncs))
            seen.append(devices._named_syncs)

        async def at_end(self, ctx):  # type: ignore[no-untyped-def]
            seen.append(devices._named_syncs)

    device = devices.Device("cpu", "optimizer")
    book = StepBook(
        device, Profiler(60.0, lambda *a, **k: None, enabled=False), lambda *a, **k: None,
        start_step=0, log_every=100, max_bad_steps=3, hooks=[Hook()],
    )  # fmt: skip
    result = StepResult(
        step=1, loss=torch.zeros(()), grad_norm=torch.zeros(()), lr=0.0, correct=torch.zeros(2),
        count=torch.zeros(2, dtype=torch.long), tokens=1, samples=1, weight_sum=1.0,
    )  # fmt: skip
    book.progress.finish(1, 0)

    async def go() -> None:
        await book.end(result, None)
        await book.close()

    try:
        asyncio.run(go())
    finally:
        device.close()
    assert seen == [0, 1, 0, 0]  # named only inside the hook's own device work


def test_flex_block_masks_are_built_without_a_host_sync():
    """The flex `BlockMask` (the drafter's mask on CUDA; training on CPU cannot use flex, it has
    no CPU backward) is built from device tensors without a host read: the eager
    `create_block_mask` under the checker, on a virtual GPU."""
    from dflash.model.drafter import DrafterSpec
    from dflash.model.masks import BlockLayout, layer_masks
    from dflash.runtime.checked import Rules

    spec = DrafterSpec(
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
        vocab_size=100, rms_norm_eps=1e-6, rope_theta=1e4, target_layer_ids=[0], num_target_layers=1,
        block_size=4, mask_token_id=0, layer_types=["full_attention", "sliding_attention"], sliding_window=8,
    )  # fmt: skip
    rules = Rules()
    with rules.working("drafter0 prepare", rules.stream("drafter0/prepare", 0), []):
        anchors = rules.upload(torch.tensor([[0, 5, 10], [2, 7, 0]]), 0)
        valid = rules.upload(torch.tensor([[True, True, True], [True, True, False]]), 0)
        docs = rules.upload(torch.tensor([[0] * 8 + [1] * 8, [0] * 12 + [-1] * 4]), 0)
        masks = layer_masks(BlockLayout(anchors, valid, docs, 4), spec, True)
    assert set(masks) == {"full_attention", "sliding_attention"} and rules.ops > 50
