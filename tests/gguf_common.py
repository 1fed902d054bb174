"""What the GGUF tests share: a tiny drafter spec per family and llama.cpp's build check (the tiny
Llama target is conftest.py's `tiny_llama`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.serving import llamacpp

SPEC = DrafterSpec(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128, vocab_size=512,
    rms_norm_eps=1e-5, rope_theta=1e4, target_layer_ids=[1, 2], num_target_layers=4, block_size=4, mask_token_id=0,
    layer_types=["full_attention", "full_attention"], sliding_window=64,
)  # fmt: skip
DFLASH2 = {"family": "dflash2", "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
FAMILIES = {
    "dflash": {},
    "dflash2": DFLASH2,
    "dspark": {"family": "dspark", "markov_rank": 8, "confidence_head": True, "confidence_with_markov": True},
}


def built() -> None:
    if not llamacpp.server_binary().is_file():
        pytest.fail(f"llama.cpp is not built in {llamacpp.home()}: `make test` (or `make llamacpp`) builds it")


def drafter_of(family: str) -> DFlashDrafter:
    torch.manual_seed(0)
    model = DFlashDrafter(dataclasses.replace(SPEC, **FAMILIES[family]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model
