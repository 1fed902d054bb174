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
from dflash.pipeline.stages import pack


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
PACKED = {"data.pack": "true", "data.max_seq_len": 96, "data.num_samples": 128}  # two or three documents a row

# A covering set, not the whole product: each kind, packing, labels, distillation and mode
# appears both ways.
MATRIX = {
    "tiny-unpacked-pipeline": ("tiny", {}),
    "tiny-packed-labels-distill-2gpus": ("tiny", {**PACKED, **TARGET_LABELS, **DISTILL}),
    "tiny-packed-serial": ("tiny", {**PACKED, **SERIAL}),
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


def test_a_planted_item_in_a_stage_fails_naming_op_and_frame(tiny_config, monkeypatch):
    real = pack.pack

    def pack_and_peek(layers):  # type: ignore[no-untyped-def]
        out = real(layers)
        if out.sum().item() > 1e30:  # a host read of a device value: a sync on a GPU
            pass
        return out

    monkeypatch.setattr(pack, "pack", pack_and_peek)
    with pytest.raises(StageError) as err:
        checked_run(tiny_config)
    msg = str(err.value)
    assert msg.startswith("stage target.pack_hidden[0] failed: CudaRuleError: target0 target.pack_hidden: sync:")
    assert "aten._local_scalar_dense" in msg and "test_sync_detector.py" in msg and "pack_and_peek" in msg


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
