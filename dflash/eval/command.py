"""`dflash eval CONFIG --drafter PATH [--prompts NAME|FILE ...]`: load the config's target
and a drafter, check they fit, and write one `eval` record per prompt set."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config
from dflash.errors import ConfigError, DataError
from dflash.eval.engine import (
    check_llamacpp_drafter,
    check_llamacpp_eval,
    check_vllm_eval,
    evaluate_in_llamacpp,
    evaluate_in_vllm,
)
from dflash.eval.engine_turns import evaluate_engine_turns
from dflash.eval.fit import check_drafter_fits
from dflash.eval.prompts import eval_prompts, load_prompt_set, reads_chat_prompts, require_eval_prompts, stop_ids
from dflash.eval.tally import DecodeSettings, evaluate, evaluate_chat
from dflash.model.drafter import DFlashDrafter, FrozenHead
from dflash.model.export import load_drafter
from dflash.model.loading import load_tokenizer
from dflash.model.target import TargetInfo, TargetShape, load_target
from dflash.model.target_head import load_target_head
from dflash.runtime.devices import check_device

__all__ = ["run_eval"]


def _load_target(cfg: Config, drafter: DFlashDrafter, device: torch.device) -> tuple[TargetInfo, Any]:
    """The config's target with the layers the drafter reads (in `eval.target_dtype` unless
    "same"; `target.load = "head"`: its embeddings and LM head only), and its tokenizer (None
    for a target without one)."""
    tcfg = cfg.target.model_copy(update={"layer_ids": drafter.spec.target_layer_ids})
    if cfg.eval.target_dtype != "same":
        tcfg = tcfg.model_copy(update={"dtype": cfg.eval.target_dtype})
    load = load_target_head if cfg.target.load == "head" else load_target
    target = load(tcfg, device, 1, cfg.data.cache_dir)
    return target, load_tokenizer(cfg.target, cfg.data.cache_dir)


def _refuse_engine(cfg: Config, engine: str) -> None:
    """Refuses, before any model is loaded, what `engine` cannot decode with this config."""
    if cfg.target.load == "head" and engine == "dflash":
        msg = "target.load = 'head': the target's decoder layers are not loaded here; decode in vLLM (--engine vllm)"
        raise ConfigError(msg)
    if engine != "dflash" and not cfg.eval.family_head:
        msg = (
            f"eval.family_head = false drafts from the backbone's logits alone, in dflash's own decoding; "
            f"--engine {engine} drafts with the family's head: use --engine dflash"
        )
        raise ConfigError(msg)
    if engine == "vllm":
        check_vllm_eval(cfg)  # before any model is loaded
    if engine == "llamacpp":
        check_llamacpp_eval(cfg)


def _load_models(
    cfg: Config, drafter_path: Path, engine: str, has_sets: bool, t_dev: torch.device, d_dev: torch.device
) -> tuple[TargetInfo, Any, DFlashDrafter, FrozenHead | None]:
    """The drafter, checked against the config's target shape before the target loads, then
    the target and its tokenizer, and the frozen head dflash's own decoding drafts with (None
    for another engine). Without prompt sets, the run's prompts must be there first."""
    drafter = load_drafter(drafter_path, d_dev)
    if engine == "llamacpp":
        check_llamacpp_drafter(drafter.spec, cfg.drafter.dspark.confidence_threshold)
    check_drafter_fits(drafter, TargetShape.from_config(cfg.target), drafter_path, cfg)  # before the target loads
    if not has_sets:
        require_eval_prompts(cfg)
    target, tokenizer = _load_target(cfg, drafter, t_dev)
    check_drafter_fits(drafter, target, drafter_path, cfg)
    head = None
    if engine == "dflash":
        head = FrozenHead(target.embed_weight, target.lm_head_weight).to(d_dev, torch.float32)
    return target, tokenizer, drafter, head


def run_eval(
    cfg: Config,
    drafter_path: Path,
    prompt_sets: Sequence[str] = (),
    limit: int | None = None,
    engine: str = "dflash",
    tensor_parallel: int = 1,
) -> list[dict[str, Any]]:
    """`dflash eval`: load the config's target and a drafter (export or checkpoint folder),
    evaluate on each prompt set (`data.prompt_sets`: mtbench, humaneval, heldout, a file;
    none: the run's held-out or random prompts, `eval.num_prompts` of them). One `eval`
    record per set, with `prompt_set`. `limit`: at most this many prompts per set.
    `engine = "vllm"` / `"llamacpp"`: decoded in vLLM / llama-server instead (`eval/engine.py`;
    every turn of a chat set, `eval/engine_turns.py`), vLLM's target over `tensor_parallel` devices."""
    _refuse_engine(cfg, engine)
    t_dev = check_device(cfg.pipeline.target_devices[0], "pipeline.target_devices[0]")
    d_dev = check_device(cfg.pipeline.drafter_devices[0], "pipeline.drafter_devices[0]")
    heldout = cfg.heldout_prompts if reads_chat_prompts(cfg) else None
    sets = [load_prompt_set(name, heldout) for name in prompt_sets]  # before any model: a bad name fails at once
    target, tokenizer, drafter, head = _load_models(cfg, drafter_path, engine, bool(sets), t_dev, d_dev)
    settings = DecodeSettings.of(cfg, stop_ids(target, tokenizer))
    if not sets:
        prompts = eval_prompts(cfg, target, tokenizer, drafter.spec.mask_token_id)[:limit]
        name = "heldout" if reads_chat_prompts(cfg) else "random"
        if engine == "vllm":
            return evaluate_in_vllm(cfg, target, drafter, drafter_path, {name: prompts}, settings,
                                    tensor_parallel=tensor_parallel)  # fmt: skip
        if engine == "llamacpp":
            return evaluate_in_llamacpp(cfg, target, drafter, drafter_path, {name: prompts}, settings)
        return [{"prompt_set": name, **evaluate(target, drafter, head, prompts, settings)}]
    if tokenizer is None:
        msg = "--prompts: chat prompt sets need a target with a tokenizer (target.kind = 'hf' or 'gguf')"
        raise DataError(msg)
    kwargs = dict(cfg.data.chat_template_kwargs)
    if engine != "dflash":  # every turn, each after the engine's own reply to the one before
        chats = {ps.name: ps.prompts[:limit] for ps in sets}
        return evaluate_engine_turns(
            cfg, engine, target, tokenizer, drafter, drafter_path, chats, settings, kwargs, tensor_parallel
        )
    return [
        {"prompt_set": ps.name, **evaluate_chat(target, drafter, head, tokenizer, ps.prompts[:limit], settings, kwargs),
         "chat_template_kwargs": kwargs}
        for ps in sets
    ]  # fmt: skip
