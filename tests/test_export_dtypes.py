"""Every family's export loads bit for bit through `AutoModel.from_pretrained(export,
trust_remote_code=True)` with its default arguments: each tensor in the value and the dtype
`model.safetensors` stores it in (the config's `torch_dtype`, and float32 for DSpark's
confidence head), and the values `dflash.load_drafter` reads."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.export import export_drafter, load_drafter

SPEC = DrafterSpec(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
    vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=[0, 2], num_target_layers=4,
    block_size=4, mask_token_id=63, layer_types=["full_attention", "sliding_attention"], sliding_window=8,
)  # fmt: skip
FAMILIES = {
    "dflash": {},
    "dflash2": {"family": "dflash2", "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8,
                "selector_top_k": 4},
    "dspark": {"family": "dspark", "markov_rank": 8, "confidence_head": True, "confidence_with_markov": True},
}  # fmt: skip


def _drafter(family: str) -> DFlashDrafter:
    """Every weight random (no identity convolution, no zero bias): a cast shows in each."""
    model = DFlashDrafter(dataclasses.replace(SPEC, **FAMILIES[family]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_automodel_loads_every_tensor_as_stored(tmp_path, family, dtype):
    from transformers import AutoModel

    path = export_drafter(_drafter(family), tmp_path / "exp", dtype=dtype)
    stored = load_file(str(path / "model.safetensors"))
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")
    wide = {k for k, v in stored.items() if v.dtype != dtype}
    fp32 = {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert wide == (fp32 if family == "dspark" and dtype != torch.float32 else set())
    for k in wide:  # float32 values a cast to the export's dtype would change: the test sees one
        assert stored[k].dtype == torch.float32 and _max_diff(stored[k].to(dtype), stored[k]) > 0

    hf, info = AutoModel.from_pretrained(str(path), trust_remote_code=True, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    got = hf.state_dict()
    ours = load_drafter(path).state_dict()
    assert set(got) == set(stored) == set(ours)
    off = {k: (str(v.dtype), str(got[k].dtype)) for k, v in stored.items() if got[k].dtype != v.dtype}
    assert not off, f"AutoModel changed dtypes (stored, loaded): {off}"
    diff = {k: _max_diff(got[k], v) for k, v in stored.items()}
    assert max(diff.values()) == 0.0, {k: d for k, d in diff.items() if d}
    vs_ours = {k: _max_diff(got[k], ours[k]) for k in stored}
    assert max(vs_ours.values()) == 0.0, {k: d for k, d in vs_ours.items() if d}


def test_dspark_confidence_through_automodel_equals_load_drafter(tmp_path):
    """The bf16 export's confidence head computes in AutoModel what it computes in dflash."""
    from transformers import AutoModel

    path = export_drafter(_drafter("dspark"), tmp_path / "exp")
    hf = AutoModel.from_pretrained(str(path), trust_remote_code=True)
    ours = load_drafter(path)
    g = torch.Generator().manual_seed(1)
    h, prev = torch.randn(3, 4, 32, generator=g), torch.randint(0, 64, (3, 4), generator=g)
    with torch.no_grad():
        a = ours.confidence_head(h, ours.markov_head.markov_w1(prev))
        b = hf.confidence_head(h, hf.markov_head.markov_w1(prev))
    assert b.dtype == torch.float32 and _max_diff(a, b) == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_speculators_export_names_the_dtype_it_stores(tmp_path, dtype):
    """The speculators format carries the weights' dtype in its `transformer_layer_config`,
    the config vLLM and speculators read the model's layers from."""
    model = _drafter("dflash")
    model.spec = dataclasses.replace(model.spec, layer_types=["full_attention"] * 2)  # one causal flag for all
    path = export_drafter(model, tmp_path / "spec", dtype=dtype, fmt="speculators")
    config = json.loads((path / "config.json").read_text())
    assert config["transformer_layer_config"]["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert {v.dtype for v in load_file(str(path / "model.safetensors")).values()} == {dtype}
