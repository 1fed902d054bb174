"""`dflash eval --engine vllm`: the same prompts, greedy, decoded by vLLM's offline API with the
export as its DFlash drafter, against vLLM's own plain greedy decoding and ours.

One `eval` record per prompt set, with `"engine": "vllm"`; `tau` is vLLM's, from its
spec-decode counters (1 + accepted draft tokens per verify step with a draft),
`acceptance_per_position` its accepted tokens per draft position over those steps,
`dflash_tau` our eval's on the same prompts (the two count the same thing: tokens per verify
step), and how many outputs equal vLLM's plain greedy output and ours. vLLM gets the prompts
as token ids (ours: the same chat template, options and stop tokens), so nothing differs
before decoding starts. Two vLLM engines run, one after the other (with the drafter, then
plain), each over every prompt set, before our decoding; a tiny target is saved for them to
a temporary folder, removed at the end.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping, Sequence
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

__all__ = ["check_vllm_eval", "evaluate_in_vllm", "target_folder"]


def check_vllm_eval(cfg: Config) -> None:
    """What `--engine vllm` refuses before any model is loaded: a Python without vLLM, and a
    sampled eval (the outputs are checked against plain greedy decoding)."""
    _greedy_only(cfg.eval.temperature)
    vllm.require_vllm()


def _greedy_only(temperature: float) -> None:
    if temperature > 0:
        msg = (
            "--engine vllm: greedy only (the outputs are checked against plain greedy decoding); "
            "drop --temperature (eval.temperature = 0)"
        )
        raise ConfigError(msg)


@contextlib.contextmanager
def target_folder(cfg: Config, target: Target) -> Iterator[Path]:
    """The target as a folder vLLM loads: the config's (`hf`, `gguf` converted once), or the
    tiny random target saved to a temporary folder, removed when the block ends."""
    if cfg.target.kind != "tiny":
        yield Path(model_folder(cfg.target, cfg.data.cache_dir))
        return
    with tempfile.TemporaryDirectory(prefix="dflash-tiny-target-") as tmp:
        target.model.save_pretrained(tmp)
        yield Path(tmp)


def evaluate_in_vllm(
    cfg: Config,
    target: Target,
    drafter: DFlashDrafter,
    drafter_path: Path,
    sets: Mapping[str, Sequence[torch.Tensor]],
    settings: DecodeSettings,
    template_kwargs: dict[str, Any] | None = None,
    tensor_parallel: int = 1,
) -> list[dict[str, Any]]:
    """The `eval` records of the export in vLLM, one per prompt set (name → token-id prompts;
    greedy only). `template_kwargs`: the chat template options the prompts were rendered with
    (a chat set's first turns), kept in each record as our chat eval's are. A target loaded
    without its decoder layers (`target.load = "head"`) has no decoding of ours to compare:
    `dflash_tau` and `identical_to_dflash_greedy` are null, `lossless` is vLLM's against itself."""
    _greedy_only(settings.temperature)
    why = vllm.problem(drafter.spec, target.head_dim, on_cpu=vllm.engine_device() == "cpu")
    if why is not None:
        raise ConfigError(f"--engine vllm: {why}")
    ids = [[p.tolist() for p in prompts] for prompts in sets.values()]
    stops, dtype, path = sorted(settings.stop_ids), target.dtype_name, drafter_path.resolve()
    with target_folder(cfg, target) as folder:
        spec_runs = vllm.decode(folder, ids, settings.max_new, stops, path, drafter.spec, dtype, tensor_parallel)
        plain_runs = vllm.decode(folder, ids, settings.max_new, stops, dtype=dtype, tensor_parallel=tensor_parallel)
    ours_too = target.model is not None  # our decoding, where the whole target is here
    head = FrozenHead(target.embed_weight, target.lm_head_weight).to(target.device, torch.float32) if ours_too else None
    chat = {"turns": 1, "chat_template_kwargs": template_kwargs} if template_kwargs is not None else {}
    records = []
    for (name, prompts), spec_run, plain in zip(sets.items(), spec_runs, plain_runs, strict=True):
        ours, mine = None, None
        if ours_too:
            ours = [greedy_generate(target, p, settings.max_new, settings.stop_ids) for p in prompts]
            mine = evaluate(target, drafter, head, prompts, settings)
        records.append({"prompt_set": name, **chat, **_record(spec_run, plain, ours, mine)})
        records[-1]["speculative_config"] = vllm.speculative_config(path, drafter.spec)
    return records


def _record(
    spec_run: vllm.EngineRun, plain: vllm.EngineRun, ours: list[list[int]] | None, mine: dict | None
) -> dict[str, Any]:
    """One prompt set's numbers: vLLM's with the drafter, against its plain outputs and ours
    (None: no decoding of ours)."""
    per_pos = spec_run.accepted_per_pos or []
    seconds, steps = spec_run.seconds, spec_run.drafts
    return {
        "engine": "vllm",
        "prompts": len(spec_run.outputs),
        "tau": round(spec_run.tau, 4),
        "verify_steps": steps,
        "accepted_tokens": spec_run.accepted,
        "accept_per_position": [round(a / steps, 4) if steps else 0.0 for a in per_pos],
        "dflash_tau": mine["tau"] if mine else None,
        "dflash_verify_steps": mine["verify_steps"] if mine else None,
        "identical_to_vllm_greedy": sum(a == b for a, b in zip(spec_run.outputs, plain.outputs, strict=True)),
        "identical_to_dflash_greedy": (
            None if ours is None else sum(a == b for a, b in zip(spec_run.outputs, ours, strict=True))
        ),
        "lossless": spec_run.outputs == plain.outputs and (ours is None or plain.outputs == ours),
        "vllm_tokens_per_s": round(sum(map(len, spec_run.outputs)) / seconds, 1) if seconds else None,
    }
