"""Export a drafter as GGUF for llama.cpp: `dflash export CKPT OUT --format gguf`.

llama.cpp (the one vendored by llama-cpp-python 0.3.36, commit 0c1e570) serves all three
families under one architecture, `dflash`: DFlash2 when the `selector_*` tensors are present,
DSpark when `markov_w1` is. What it reads, and what this module writes (the same keys, tensor
names and types as llama.cpp's own converter, `convert_hf_to_gguf.py`, writes from our
reference-format export; tests/test_gguf.py compares the two):
- `dflash.target_layers` = our layer ids **+ 1** (llama.cpp captures a layer's *input*);
  `dflash.block_size`; DFlash2's `conv_kernel_size`, `conv_group_size`, `selector_rank`,
  `selector_top_k`; DSpark's `sample_from_anchor` (true: the block is [anchor, mask × (B−1)])
  and `has_confidence_head`; the Qwen3 backbone's usual keys.
- No token embedding and no LM head: the target's are borrowed; but a drafter with a draft
  vocabulary writes its own head (`output.weight`, V' rows) and `d2t` (int64 target ids), which
  llama.cpp scatters the draft logits through (DFlash2's successor codebook over every id).
  The tokenizer metadata is the target's own (`tokenizer.*` from its GGUF), with
  `tokenizer.ggml.mask_token_id` ours;
  llama.cpp refuses a draft whose vocabulary differs from the target's.
- llama.cpp hooks the inputs of decoder layers 0 … n_layer − 1 only, and only in the
  architectures listed in `HOOKED_ARCHS`: a drafter reading the target's last layer (our id
  n_layer − 1) aborts there, as does any drafter beside a target of another architecture
  (qwen2, gemma3, phi3, ...). Both are refused here, before anything is written.
The `gguf` package from PyPI writes the file (it predates DFlash in llama.cpp: the keys are
written by name).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.errors import CheckpointError
from dflash.model.drafter import DrafterSpec
from dflash.store.atomic import atomic_path

__all__ = ["GGUF_TYPES", "HOOKED_ARCHS", "TargetGGUF", "gguf_problem", "read_target_gguf", "write_gguf"]

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
_FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama_ftype, as general.file_type

# The llama.cpp architectures whose graphs record each decoder layer's input (`t_layer_inp`,
# src/models/*.cpp at 0c1e570): the only targets a DFlash drafter can read in llama.cpp.
HOOKED_ARCHS = frozenset({
    "llama", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "qwen4exp", "gemma4", "gpt-oss",
    "lfm2", "nemotron_h", "deepseek4", "mimo2", "minimax-01", "minimax-m2", "bailingmoe3", "hunyuan_vl",
    "muse-glimmer", "nanbeige",
})  # fmt: skip

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
_TOP = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
    "lm_head.weight": "output.weight",  # a draft vocabulary's own head
    "d2t": "d2t",  # ... and its rows' target ids (absolute, int64, as llama.cpp reads them)
}


def _gguf() -> Any:
    """The `gguf` package, or one line saying how to get it."""
    try:
        import gguf
    except ImportError:
        msg = "GGUF needs the gguf package: pip install 'gguf>=0.17' (or pip install -e '.[gguf]')"
        raise CheckpointError(msg) from None
    return gguf


def gguf_name(name: str) -> str:
    """Our parameter name → llama.cpp's tensor name."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    msg = f"GGUF export: no llama.cpp name for the drafter weight {name!r}"
    raise CheckpointError(msg)


@dataclass(frozen=True)
class TargetGGUF:
    """What the drafter's GGUF needs from the target's: its architecture and shape (for the
    refusals) and its tokenizer metadata (copied)."""

    path: Path  # the target as named to the user
    arch: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer: dict[str, tuple[Any, Any, Any]]  # key → (value, type, array item type)
    tokens: tuple[str, ...]


def read_target_gguf(path: str | Path, source: str | Path | None = None) -> TargetGGUF:
    """The target's GGUF (the model, or a vocabulary-only file): one line when unreadable.
    `source`: the target as the user named it (a folder converted to `path`), for messages."""
    gguf = _gguf()
    GGUFReader, GGUFValueType = gguf.GGUFReader, gguf.GGUFValueType

    p = Path(path)
    try:
        reader = GGUFReader(p)
    except (OSError, ValueError, IndexError) as err:
        msg = f"{p}: not a readable GGUF file ({err})"
        raise CheckpointError(msg) from None
    fields = reader.fields

    def value(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    arch = value("general.architecture")
    tokens = value("tokenizer.ggml.tokens")
    if not isinstance(arch, str) or not tokens:
        msg = f"{p}: a GGUF without general.architecture or tokenizer.ggml.tokens"
        raise CheckpointError(msg)
    tokenizer = {}
    for key, field in fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.ggml.mask_token_id":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        tokenizer[key] = (field.contents(), vtype, sub)
    return TargetGGUF(
        path=Path(source) if source is not None else p, arch=arch, num_layers=int(value(f"{arch}.block_count") or 0),
        hidden_size=int(value(f"{arch}.embedding_length") or 0), vocab_size=len(tokens),
        tokenizer=tokenizer, tokens=tuple(tokens),
    )  # fmt: skip


def gguf_problem(spec: DrafterSpec, target: TargetGGUF) -> str | None:
    """Why llama.cpp cannot draft with this drafter beside this target; None when it can."""
    if target.arch not in HOOKED_ARCHS:
        return (
            f"llama.cpp cannot give a drafter the hidden states of a {target.arch!r} target (it records layer "
            f"inputs only in {', '.join(sorted(HOOKED_ARCHS))})"
        )
    if spec.hidden_size != target.hidden_size:
        return f"the drafter's hidden size {spec.hidden_size} is not the target's {target.hidden_size} ({target.path})"
    if spec.vocab_size != target.vocab_size:
        return f"the drafter's vocabulary ({spec.vocab_size}) is not the target's ({target.vocab_size}, {target.path})"
    last = target.num_layers - 1
    if max(spec.target_layer_ids) >= last:
        return (
            f"the drafter reads target layer {max(spec.target_layer_ids)}, the last of {target.num_layers}: llama.cpp "
            f"hooks layer inputs only, so drafters read layers 0-{last - 1}: train with target.layer_ids below {last}"
        )
    return None


def _rope_keys(spec: DrafterSpec) -> dict[str, Any]:
    """RoPE scaling as llama.cpp's converter writes it for a DFlash draft: linear and yarn."""
    rs = spec.rope_scaling
    kind = (rs or {}).get("rope_type", (rs or {}).get("type"))
    if kind in (None, "default"):
        return {}
    if kind == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": float(rs["factor"])}
    if kind == "yarn":
        keys = {
            "rope.scaling.type": "yarn", "rope.scaling.factor": float(rs["factor"]),
            "rope.scaling.original_context_length": int(rs["original_max_position_embeddings"]),
        }  # fmt: skip
        for ours, theirs in (("extrapolation_factor", "yarn_ext_factor"), ("beta_fast", "yarn_beta_fast"),
                             ("beta_slow", "yarn_beta_slow")):  # fmt: skip
            if rs.get(ours) is not None:
                keys[f"rope.scaling.{theirs}"] = float(rs[ours])
        attn = rs.get("attention_factor", rs.get("attn_factor"))
        if attn is not None:
            keys["rope.scaling.yarn_attn_factor"] = float(attn)
        return keys
    msg = f"GGUF export: llama.cpp's DFlash drafts take linear or yarn RoPE scaling, not {kind!r}"
    raise CheckpointError(msg)


def _arch_keys(spec: DrafterSpec) -> dict[str, Any]:
    keys: dict[str, Any] = {
        "block_count": spec.num_layers,
        "context_length": spec.max_position_embeddings,
        "embedding_length": spec.hidden_size,
        "feed_forward_length": spec.intermediate_size,
        "attention.head_count": spec.num_heads,
        "attention.head_count_kv": spec.num_kv_heads,
        "rope.freq_base": float(spec.rope_theta),
        "attention.layer_norm_rms_epsilon": float(spec.rms_norm_eps),
        "attention.key_length": spec.head_dim,
        "attention.value_length": spec.head_dim,
        **_rope_keys(spec),
        "block_size": spec.block_size,
    }
    if spec.family == "dflash2":
        keys |= {
            "conv_kernel_size": spec.conv_kernel_size, "conv_group_size": spec.conv_group_size,
            "selector_rank": spec.selector_rank, "selector_top_k": spec.selector_top_k,
        }  # fmt: skip
    keys["target_layers"] = [i + 1 for i in spec.target_layer_ids]
    if "sliding_attention" in spec.layer_types:
        keys["attention.sliding_window"] = spec.sliding_window
        keys["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in spec.layer_types]
    if not spec.sliding_causal_block:  # the export's `causal = false`
        keys["attention.causal"] = False
    if spec.family == "dspark":
        keys |= {"sample_from_anchor": True, "has_confidence_head": spec.confidence_head}
    return {f"dflash.{k}": v for k, v in keys.items()}


def _for_llamacpp(spec: DrafterSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights as llama.cpp reads a draft vocabulary: `d2t` as target ids, no `t2d`, and
    DFlash2's successor codebook over the whole vocabulary (its selector walks the logits after
    they are scattered to the target's ids; rows outside the draft vocabulary are zero and never
    a candidate, as their logits are -inf)."""
    if not spec.draft_vocab_size:
        return dict(state)
    out = {k: v for k, v in state.items() if k != "t2d"}
    ids = state["d2t"].to("cpu", torch.int64) + torch.arange(spec.draft_vocab_size)
    out["d2t"] = ids
    succ = "candidate_selector.successor_codebook"
    if succ in out:
        rows = out[succ].detach().to("cpu", torch.float32)
        out[succ] = torch.zeros(spec.vocab_size, rows.shape[1]).index_copy_(0, ids, rows)
    return out


def _tensor(gguf_key: str, t: torch.Tensor, gtype: str) -> tuple[np.ndarray, Any]:
    """(data, raw type or None) by llama.cpp's converter's rules: 1-D tensors, norms and the
    convolutions' base kernels stay float32; q8_0 where a row is a whole number of 32-blocks,
    else float16; a draft vocabulary's `d2t` is int64."""
    from gguf import GGMLQuantizationType, quants

    if not t.is_floating_point():
        return t.detach().to("cpu", torch.int64).numpy(), GGMLQuantizationType.I64
    data = t.detach().to("cpu", torch.float32).numpy()
    keep_f32 = data.ndim <= 1 or gguf_key.endswith(("_norm.weight", "_conv_base"))
    if gtype == "f32" or keep_f32:
        return data, None
    if gtype == "f16" or (gtype == "q8_0" and data.shape[-1] % 32):
        return data.astype(np.float16), None
    qtype = GGMLQuantizationType.BF16 if gtype == "bf16" else GGMLQuantizationType.Q8_0
    return quants.quantize(data, qtype), qtype


def write_gguf(
    spec: DrafterSpec,
    state: dict[str, torch.Tensor],
    target: TargetGGUF,
    out: str | Path,
    gtype: str = "f16",
    name: str = "",
) -> Path:
    """The drafter as one GGUF file at `out` (written whole or not at all), refused in one
    line first when llama.cpp could not draft with it beside `target`."""
    gguf = _gguf()
    GGUFValueType, GGUFWriter = gguf.GGUFValueType, gguf.GGUFWriter

    if gtype not in GGUF_TYPES:
        msg = f"GGUF export: type {gtype!r} is not one of {', '.join(GGUF_TYPES)}"
        raise CheckpointError(msg)
    why = gguf_problem(spec, target)
    if why is not None:
        raise CheckpointError(f"GGUF export: {why}")
    arch_keys = _arch_keys(spec)
    tensors = [(gguf_name(k), v) for k, v in _for_llamacpp(spec, state).items()]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        writer = GGUFWriter(str(tmp), "dflash")
        writer.add_type("model")
        writer.add_name(name or f"dflash {spec.family} drafter")
        for key, val in arch_keys.items():
            _add(writer, key, val)
        writer.add_uint32("general.file_type", _FILE_TYPE[gtype])
        writer.add_quantization_version(2)
        for key, (val, vtype, sub) in target.tokenizer.items():
            writer.add_key_value(key, val, vtype, sub_type=sub if vtype == GGUFValueType.ARRAY else None)
        writer.add_uint32("tokenizer.ggml.mask_token_id", spec.mask_token_id)
        for key, t in tensors:
            data, raw = _tensor(key, t, gtype)
            writer.add_tensor(key, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def _add(writer: Any, key: str, val: Any) -> None:
    if isinstance(val, bool):
        writer.add_bool(key, val)
    elif isinstance(val, int):
        writer.add_uint32(key, val)
    elif isinstance(val, float):
        writer.add_float32(key, val)
    elif isinstance(val, str):
        writer.add_string(key, val)
    elif all(isinstance(v, bool) for v in val):
        writer.add_array(key, list(val))
    else:  # the converter's target_layers: int32
        from gguf import GGUFValueType

        writer.add_key_value(key, list(val), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
