"""`dflash eval --engine vllm`: the same prompts, greedy, decoded by vLLM's offline API with the
export as its DFlash drafter, against vLLM's own plain greedy decoding and ours.

The `eval` record says `"engine": "vllm"`; `tau` is vLLM's, from its spec-decode counters (1 +
accepted draft tokens per verify step with a draft), `acceptance_per_position` its accepted
tokens per draft position over those steps, `dflash_tau` our eval's on the same prompts (the
two count the same thing: tokens per verify step), and how many outputs equal vLLM's plain
greedy output and ours. vLLM gets the prompts as token ids (ours: the same chat template and
stop tokens), so nothing differs before decoding starts.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config
from dflash.engines import vllm
from dflash.errors import ConfigError
from dflash.eval.decode import greedy_generate
from dflash.eval.tally import DecodeSettings, evaluate
from dflash.model.drafter import DFlashDrafter, FrozenHead
from dflash.model.loading import model_folder
from dflash.model.target import Target

__all__ = ["evaluate_in_vllm", "target_folder"]


def target_folder(cfg: Config, target: Target) -> Path:
    """The target as a folder vLLM loads: the config's (`hf`, `gguf` converted once), or the
    tiny random target saved to a temporary folder."""
    if cfg.target.kind != "tiny":
        return Path(model_folder(cfg.target, cfg.data.cache_dir))
    folder = Path(tempfile.mkdtemp(prefix="dflash-tiny-target-"))
    target.model.save_pretrained(folder)
    return folder


def evaluate_in_vllm(
    cfg: Config,
    target: Target,
    drafter: DFlashDrafter,
    drafter_path: Path,
    prompts: Sequence[torch.Tensor],
    settings: DecodeSettings,
) -> dict[str, Any]:
    """The `eval` record of the export in vLLM over token-id prompts (greedy only)."""
    if settings.temperature > 0:
        msg = "--engine vllm: greedy only (the outputs are checked against plain greedy decoding); drop --temperature"
        raise ConfigError(msg)
    why = vllm.problem(drafter.spec, target.head_dim, on_cpu=target.device.type == "cpu")
    if why is not None:
        raise ConfigError(f"--engine vllm: {why}")
    folder = target_folder(cfg, target)
    ids = [p.tolist() for p in prompts]
    stops = sorted(settings.stop_ids)
    dtype = target.dtype_name
    spec_run = vllm.decode(folder, ids, settings.max_new, stops, drafter_path.resolve(), drafter.spec, dtype)
    plain = vllm.decode(folder, ids, settings.max_new, stops, dtype=target.dtype_name)
    ours = [greedy_generate(target, p, settings.max_new, settings.stop_ids) for p in prompts]
    head = FrozenHead(target.embed_weight, target.lm_head_weight).to(target.device, torch.float32)
    mine = evaluate(target, drafter, head, prompts, settings)
    per_pos = spec_run.accepted_per_pos or []
    return {
        "engine": "vllm",
        "prompts": len(prompts),
        "tau": round(spec_run.tau, 4),
        "verify_steps": spec_run.drafts,
        "accepted_tokens": spec_run.accepted,
        "accept_per_position": [round(a / spec_run.drafts, 4) if spec_run.drafts else 0.0 for a in per_pos],
        "dflash_tau": mine["tau"],
        "dflash_verify_steps": mine["verify_steps"],
        "identical_to_vllm_greedy": sum(a == b for a, b in zip(spec_run.outputs, plain.outputs, strict=True)),
        "identical_to_dflash_greedy": sum(a == b for a, b in zip(spec_run.outputs, ours, strict=True)),
        "lossless": spec_run.outputs == plain.outputs == ours,
        "vllm_tokens_per_s": round(sum(map(len, spec_run.outputs)) / spec_run.seconds, 1) if spec_run.seconds else None,
        "speculative_config": vllm.speculative_config(drafter_path.resolve(), drafter.spec),
    }
