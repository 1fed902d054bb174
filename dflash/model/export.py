"""Export a drafter in the format the reference DFlash code and vLLM / SGLang load:
a folder with a Qwen3-style `config.json` and `model.safetensors` (no embedding, no LM
head), written atomically (`dflash.store.atomic.atomic_path`). `load_drafter` reads it back, and
reads a training checkpoint folder too; `export_checkpoint` turns any checkpoint (mid-run,
emergency, final) into an export (`dflash export CHECKPOINT OUT_DIR`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash.errors import CheckpointError
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.store.atomic import atomic_path

_MODELING = Path(__file__).parent / "modeling_dflash.py"

__all__ = [
    "drafter_config_json",
    "export_checkpoint",
    "export_drafter",
    "is_checkpoint",
    "is_export",
    "load_drafter",
    "run_target",
    "weight_mismatches",
]


ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}
_FAMILY_OF = {arch: family for family, arch in ARCHITECTURES.items()} | {"DSparkDraftModel": "dspark"}  # vLLM's alias


def drafter_config_json(spec: DrafterSpec) -> dict[str, Any]:
    """The reference format (z-lab's, vLLM's): the architecture names the family."""
    return {
        "architectures": [ARCHITECTURES[spec.family]],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": dict(spec.rope_scaling) if spec.rope_scaling else None,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "num_target_layers": spec.num_target_layers,
        "block_size": spec.block_size,
        "layer_types": list(spec.layer_types),
        "sliding_window": spec.sliding_window,
        "use_sliding_window": "sliding_attention" in spec.layer_types,
        "auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"},
        **({"draft_vocab_size": spec.draft_vocab_size} if spec.draft_vocab_size else {}),
        "dflash_config": {
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": list(spec.target_layer_ids),
            "sliding_causal_block": spec.sliding_causal_block,
            # vLLM reads `causal`, not ours: written only as false (a block bidirectional in the
            # sliding layers too); true would make vLLM's full layers causal as well.
            **({} if spec.sliding_causal_block else {"causal": False}),
            **_dflash2_keys(spec),
        },
        **_dspark_keys(spec),
    }


def _dflash2_keys(spec: DrafterSpec) -> dict[str, Any]:
    if spec.family != "dflash2":
        return {}
    return {
        "conv_kernel_size": spec.conv_kernel_size, "conv_group_size": spec.conv_group_size,
        "selector_rank": spec.selector_rank, "selector_top_k": spec.selector_top_k,
    }  # fmt: skip


def _dspark_keys(spec: DrafterSpec) -> dict[str, Any]:
    """DSpark's keys sit at the top level of the config (vLLM's `qwen3_dspark.py` reads them
    there; `sample_from_anchor` written, as its default differs between engines)."""
    if spec.family != "dspark":
        return {}
    return {
        "markov_rank": spec.markov_rank, "enable_confidence_head": spec.confidence_head,
        "confidence_head_with_markov": spec.confidence_with_markov, "sample_from_anchor": True,
    }  # fmt: skip


def speculators_config_json(spec: DrafterSpec, verifier: str = "") -> dict[str, Any]:
    """vLLM's second DFlash format (the `speculators` library's): the model's config nested
    in `transformer_layer_config`, the target's layers as `aux_hidden_state_layer_ids` (our ids
    + 1: vLLM counts a layer's input), `speculative_tokens` = block size − 1. vLLM sets
    `causal` from `sliding_window_non_causal` for every layer, so a drafter with causal
    sliding blocks (`drafter.sliding_causal_block`) would get causal full layers too: refused."""
    if "sliding_attention" in spec.layer_types and spec.sliding_causal_block:
        msg = (
            "--format speculators: vLLM would make this drafter's full layers causal too (it reads one "
            "causal flag for all layers); export it in the default format"
        )
        raise CheckpointError(msg)
    if spec.family == "dflash2" and spec.draft_vocab_size:
        msg = "--format speculators: speculators' DFlash2 has no draft vocabulary; export it in the default format"
        raise CheckpointError(msg)
    family = _dflash2_keys(spec) | _dspark_keys(spec)
    ours_only = ("dflash_config", "auto_map", "architectures", "draft_vocab_size", *family)
    layers = {k: v for k, v in drafter_config_json(spec).items() if k not in ours_only}
    return {
        "architectures": [_SPECULATORS_ARCH[spec.family]],
        "speculators_model_type": spec.family,
        "speculators_config": {
            "algorithm": spec.family,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.drafts}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "transformer_layer_config": layers,
        "mask_token_id": spec.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in spec.target_layer_ids],
        "draft_vocab_size": spec.draft_vocab_size or spec.vocab_size,
        "sliding_window_non_causal": True,
        "block_size": spec.block_size,
        "sample_from_anchor": spec.family == "dspark",
        **({"markov_head_type": "vanilla"} if spec.family == "dspark" else {}),
        **family,
    }


def speculative_config(drafter: str | Path, spec: DrafterSpec) -> dict[str, Any]:
    """What vLLM's `speculative_config` must say to run the export at `drafter` (in either
    format: the offline API wants the token count even from a speculators config). DFlash2 is
    method "dflash" too (its architecture selects it); DSpark is "dspark"."""
    method = "dspark" if spec.family == "dspark" else "dflash"
    return {"method": method, "model": str(drafter), "num_speculative_tokens": spec.drafts}


_SPECULATORS_ARCH = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkSpeculator"}


def export_drafter(
    model: DFlashDrafter,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    fmt: str = "dflash",
    verifier: str = "",
) -> Path:
    """`fmt`: "dflash" (the reference format) or "speculators" (`speculators_config_json`)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = drafter_config_json(model.spec) if fmt == "dflash" else speculators_config_json(model.spec, verifier)
    layers = config if fmt == "dflash" else config["transformer_layer_config"]
    layers["torch_dtype"] = str(dtype).removeprefix("torch.")  # the weights': what AutoModel loads by default
    tensors = {k: _stored(k, v, dtype) for k, v in model.state_dict().items()}
    with atomic_path(out, folder=True) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # the self-contained modeling file AutoModel(..., trust_remote_code=True) loads
        shutil.copyfile(_MODELING, tmp / "modeling_dflash.py")
    return out


def _stored(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight as exports store it: in `dtype`, but DSpark's confidence head in float32 (vLLM
    loads it so) and a draft vocabulary's maps as they are (`d2t` int64, `t2d` bool)."""
    t = tensor.detach().to("cpu")
    if not t.is_floating_point():
        return t.contiguous()
    return t.to(torch.float32 if name.startswith("confidence_head.") else dtype).contiguous()


def _draft_vocab_size(cfg: dict[str, Any]) -> int:
    """A config's draft vocabulary rows; 0 for the whole vocabulary."""
    size = int(cfg.get("draft_vocab_size") or 0)
    return size if 0 < size < int(cfg["vocab_size"]) else 0


def _family_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The DrafterSpec fields of the family the config's architecture names."""
    archs = cfg.get("architectures") or ["DFlashDraftModel"]
    family = _FAMILY_OF.get(archs[0] if isinstance(archs, list) and archs else "")
    if family is None:
        msg = f"drafter config.json: architecture {archs} is none of {', '.join(_FAMILY_OF)}"
        raise CheckpointError(msg)
    d = cfg.get("dflash_config") or {}
    if family == "dflash2":
        keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        return {"family": family, **{k: int(d[k]) for k in keys}}
    if family == "dspark":
        if not cfg.get("sample_from_anchor", True):
            msg = "drafter config.json: a DSpark drafter with sample_from_anchor false is not one dflash trains"
            raise CheckpointError(msg)
        conf = bool(cfg.get("enable_confidence_head", False))
        return {
            "family": family, "markov_rank": int(cfg["markov_rank"]), "confidence_head": conf,
            "confidence_with_markov": conf and bool(cfg.get("confidence_head_with_markov", False)),
        }  # fmt: skip
    return {}


def _spec_from_config(cfg: dict[str, Any]) -> DrafterSpec:
    d = cfg.get("dflash_config") or {}
    try:
        return DrafterSpec(
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            target_layer_ids=[int(i) for i in d["target_layer_ids"]],
            num_target_layers=int(cfg["num_target_layers"]),
            block_size=int(cfg.get("block_size", 16)),
            mask_token_id=int(d["mask_token_id"]),
            layer_types=list(cfg.get("layer_types") or ["full_attention"] * int(cfg["num_hidden_layers"])),
            sliding_window=int(cfg.get("sliding_window") or 2048),
            sliding_causal_block=bool(d.get("sliding_causal_block", True)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            rope_scaling=dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None,
            draft_vocab_size=_draft_vocab_size(cfg),
            **_family_fields(cfg),
        )
    except (KeyError, TypeError, ValueError) as err:
        msg = f"drafter config.json is missing or has a bad field: {err}"
        raise CheckpointError(msg) from None


def _from_speculators(cfg: dict[str, Any]) -> dict[str, Any]:
    """A speculators config as ours. `sliding_window_non_causal` says how sliding layers see
    their block; a drafter without any keeps `sliding_causal_block`'s default (the export
    writes the flag true for every drafter it takes, as vLLM needs)."""
    try:
        flat = dict(cfg["transformer_layer_config"])
        sliding = "sliding_attention" in (flat.get("layer_types") or [])
        family = str(cfg["speculators_model_type"])
        flat["architectures"] = [ARCHITECTURES[family]]
        flat["draft_vocab_size"] = cfg.get("draft_vocab_size")
        flat["dflash_config"] = {
            "mask_token_id": cfg["mask_token_id"],
            "target_layer_ids": [int(i) - 1 for i in cfg["aux_hidden_state_layer_ids"]],
            "sliding_causal_block": not cfg.get("sliding_window_non_causal", True) if sliding else True,
        }
        anchor = cfg.get("sample_from_anchor", family == "dspark")  # speculators' default
        if anchor != (family == "dspark"):
            msg = f"speculators config.json: a {family} drafter with sample_from_anchor {anchor}: not one dflash trains"
            raise CheckpointError(msg)
        if family == "dflash2":  # speculators' defaults where a key is missing
            defaults = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
            flat["dflash_config"].update({k: cfg.get(k, v) for k, v in defaults.items()})
        if family == "dspark":
            if cfg.get("markov_head_type", "vanilla") != "vanilla":
                msg = f"speculators config.json: markov_head_type {cfg['markov_head_type']!r}: only 'vanilla' is served"
                raise CheckpointError(msg)
            defaults = {"markov_rank": 256, "enable_confidence_head": True, "confidence_head_with_markov": True}
            flat.update({k: cfg.get(k, v) for k, v in defaults.items()}, sample_from_anchor=True)
    except (KeyError, TypeError, ValueError) as err:
        msg = f"speculators config.json is missing or has a bad field: {err}"
        raise CheckpointError(msg) from None
    return flat


def is_checkpoint(path: Path) -> bool:
    """A training checkpoint folder (`<run>/checkpoints/step_N`), not an export."""
    return (path / "state.json").is_file() and (path / "drafter.safetensors").is_file()


def _from_checkpoint(path: Path) -> DFlashDrafter:
    try:
        state = json.loads((path / "state.json").read_text())
        spec = DrafterSpec(**state["spec"])
        weights = load_file(str(path / "drafter.safetensors"))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, SafetensorError, OSError) as err:
        msg = f"{path}: unreadable checkpoint: {' '.join(str(err).split())[:200]}"
        raise CheckpointError(msg) from None
    model = DFlashDrafter(spec)
    _load_weights(model, weights, path / "drafter.safetensors")
    return model


def weight_mismatches(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """How `state` differs from `model`'s own tensors, a few of each kind ('fc.weight (64, 128)
    vs (32, 64) here', 'missing ...', 'unexpected ...'); [] when it loads."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)} here" for k in own
              if k in state and state[k].shape != own[k].shape]  # fmt: skip
    out = shapes[:3]
    if missing:
        out.append(f"missing {missing[:3]}")
    if unexpected:
        out.append(f"unexpected {unexpected[:3]}")
    return out


def _load_weights(model: DFlashDrafter, state: dict[str, torch.Tensor], where: Path) -> None:
    wrong = weight_mismatches(model, state)
    if wrong:
        msg = f"{where}: weights do not match the drafter's config ({model.spec.family}): {'; '.join(wrong)}"
        raise CheckpointError(msg)
    model.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()})


def is_export(path: Path) -> bool:
    """An exported drafter folder (config.json with dflash_config, and model.safetensors)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    ours = isinstance(cfg, dict) and ("dflash_config" in cfg or cfg.get("speculators_model_type") in ARCHITECTURES)
    return ours and (path / "model.safetensors").is_file()


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, fmt: str = "dflash") -> Path:
    """A checkpoint folder → an export folder (bf16, like the end-of-run export). OUT_DIR
    must not exist, or be an earlier export (which is replaced); never a folder holding
    anything else (a run, its checkpoints), and never the checkpoint or a folder above it."""
    p, out = Path(checkpoint), Path(out_dir)
    if not p.is_dir() or not is_checkpoint(p):
        msg = f"{p}: not a dflash checkpoint folder (needs state.json and drafter.safetensors)"
        raise CheckpointError(msg)
    if out.exists() and not is_export(out):
        msg = f"{out} exists and is not an exported drafter: give a new folder (nothing was written)"
        raise CheckpointError(msg)
    if out.resolve() == p.resolve() or out.resolve() in p.resolve().parents:
        msg = f"{out} holds the checkpoint {p}: give another folder"
        raise CheckpointError(msg)
    return export_drafter(_from_checkpoint(p), out, fmt=fmt, verifier=_verifier(p))


def run_target(checkpoint: Path) -> tuple[str, str, str] | None:
    """(target.kind, target.path, data.cache_dir) of the run a checkpoint folder belongs to
    (its config.toml); None when it names no target path (the tiny target, no config)."""
    import tomllib

    try:
        raw = tomllib.loads((checkpoint / "config.toml").read_text())
    except (OSError, ValueError):
        return None
    target, data = raw.get("target") or {}, raw.get("data") or {}
    path = target.get("path")
    if not isinstance(path, str) or not path:
        return None
    return str(target.get("kind", "")), path, str(data.get("cache_dir") or "")


def _verifier(checkpoint: Path) -> str:
    """The target a checkpoint's run trained against, as the absolute path of its Hugging Face
    folder (what vLLM loads as the target when it serves a speculators export): an `hf`
    target's folder (a relative path: from here), a `gguf` target's converted folder when
    the run made one; else "" (the tiny target, a folder not found)."""
    found = run_target(checkpoint)
    if found is None:
        return ""
    kind, path, cache_dir = found
    if kind == "hf":
        folder = Path(path).expanduser()
        return str(folder.resolve()) if (folder / "config.json").is_file() else ""
    if kind == "gguf":
        return _converted_gguf(path, cache_dir)
    return ""


def _converted_gguf(path: str, cache_dir: str) -> str:
    """The folder a GGUF target was converted into (dflash.model.loading.model_folder), when
    exactly one conversion of that file is cached; else ""."""
    import glob

    from dflash.errors import ConfigError
    from dflash.model.loading import cache_root, resolve_gguf

    try:
        stem = resolve_gguf(path).stem
    except ConfigError:
        return ""
    name = glob.escape(stem) + "-" + "[0-9a-f]" * 16  # model_folder's: the file's stem, a 16-digit key
    found = glob.glob(str(cache_root(cache_dir) / "models" / name / "config.json"))
    return str(Path(found[0]).parent.resolve()) if len(found) == 1 else ""


def load_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    """Load an exported drafter folder (config.json + model.safetensors), or the drafter of
    a training checkpoint folder (state.json + drafter.safetensors, fp32)."""
    p = Path(path)
    cfg_file, weights = p / "config.json", p / "model.safetensors"
    if not p.is_dir():
        msg = f"drafter not found: {p} is not a folder"
        raise CheckpointError(msg)
    if is_checkpoint(p):
        return _from_checkpoint(p).to(device=device, dtype=dtype)
    if not cfg_file.is_file() or not weights.is_file():
        msg = f"{p}: neither an exported drafter (config.json + model.safetensors) nor a checkpoint"
        raise CheckpointError(msg)
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        msg = f"{cfg_file}: not valid JSON: {err}"
        raise CheckpointError(msg) from None
    if cfg.get("speculators_model_type") in ARCHITECTURES:  # the speculators format: back to ours
        cfg = _from_speculators(cfg)
    model = DFlashDrafter(_spec_from_config(cfg))
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        msg = f"{weights}: unreadable safetensors file: {err}"
        raise CheckpointError(msg) from None
    _load_weights(model, state, weights)
    return model.to(device=device, dtype=dtype)
