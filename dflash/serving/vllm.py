"""vLLM at the serving end: whether vLLM can run a drafter at all, the server command, and
greedy decoding in vLLM's offline API with the export as drafter, against vLLM's own plain
greedy decoding of the same prompts (`dflash eval --engine vllm`).

Facts this module encodes (vLLM 0.32):
- vLLM never reads our `block_size`: it drafts `num_speculative_tokens` = block size − 1
  tokens per step (DSpark: block size), and picks the DFlash proposer only with `"method":
  "dflash"` (DFlash2 too; DSpark: "dspark"; without it, a path without "dflash" in it runs
  the drafter as a plain draft model, silently): `dflash.model.export.speculative_config`.
  Its CPU build runs neither DFlash2 nor DSpark (the V1 runner refuses them, the V2 runner
  needs Triton).
- It reads `dflash_config.causal` (written by the export only as `false`, for a block that is
  bidirectional in sliding layers), `mask_token_id` and `target_layer_ids`.
- On CPU its attention takes head dims 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512
  only, for the target too; drafters mixing full and sliding layers need its V2 runner,
  which needs Triton (none on CPU).
Opening, sizing and shutting an engine: `dflash/engines/vllm.py`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dflash.engines.vllm import engine_device, open_engine, runner_env, shut_down
from dflash.model.drafter import DrafterSpec
from dflash.model.export import speculative_config
from dflash.serving import EngineRun

__all__ = ["CPU_HEAD_DIMS", "EngineRun", "decode", "problem", "serve_command", "speculative_config"]


CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def serve_command(target: str | Path, drafter: str | Path, spec: DrafterSpec) -> str:
    """The vLLM server command for the target with this drafter."""
    import json

    conf = json.dumps(speculative_config(drafter, spec), separators=(",", ":"))
    return f"vllm serve {target} --speculative-config '{conf}'"


def problem(spec: DrafterSpec, target_head_dim: int, on_cpu: bool) -> str | None:
    """Why vLLM cannot run this drafter (with a target of this head dim), and what to change;
    None when it can."""
    if spec.family == "dflash2" and spec.draft_vocab_size:
        return (
            "vLLM's DFlash2 has no draft vocabulary (its selector walks the whole one): train it with "
            "drafter.draft_vocab_size = 0, or serve it in llama.cpp"
        )
    if on_cpu and spec.family != "dflash":
        return (
            f"vLLM on CPU cannot run a {spec.family} drafter (its V1 runner refuses it, the V2 runner needs "
            "Triton): evaluate it with dflash eval's own decoding, or run vLLM on a GPU"
        )
    if on_cpu:
        for who, dim in (("drafter", spec.head_dim), ("target", target_head_dim)):
            if dim not in CPU_HEAD_DIMS:
                return (
                    f"vLLM on CPU cannot run a {who} with head dim {dim}: its attention takes "
                    f"{', '.join(map(str, CPU_HEAD_DIMS))} (the drafter's is drafter.head_dim, or the target's)"
                )
        if len(set(spec.layer_types)) > 1:
            return (
                "vLLM on CPU cannot run a drafter mixing full and sliding-window layers (its V1 runner refuses "
                "them, the V2 runner needs Triton): drafter.layer_types all 'full_attention', or run it on a GPU"
            )
    return None


def _counters(metrics: Iterable[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in metrics:
        name = getattr(m, "name", "")
        if name.startswith("vllm:spec_decode"):
            out[name] = getattr(m, "values", None) or getattr(m, "value", 0)
    return out


def _since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The counters' growth from `before` to `after` (a list counter: per element)."""
    out: dict[str, Any] = {}
    for name, value in after.items():
        was = before.get(name)
        if isinstance(value, list):
            old = was if isinstance(was, list) else []
            out[name] = [v - (old[j] if j < len(old) else 0) for j, v in enumerate(value)]
        else:
            out[name] = value - (was if isinstance(was, int | float) else 0)
    return out


def _generate(llm: Any, params: Any, prompts: Sequence[list[int]], counted: bool) -> EngineRun:
    """One set's outputs and, when `counted`, the spec-decode counters it added."""
    import time

    from vllm.inputs import TokensPrompt

    if not prompts:
        return EngineRun([])
    before = _counters(llm.get_metrics()) if counted else {}
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    run = EngineRun([list(o.outputs[0].token_ids) for o in outs], seconds=time.perf_counter() - t0)
    if counted:
        c = _since(before, _counters(llm.get_metrics()))
        run.drafts = int(c.get("vllm:spec_decode_num_drafts", 0))
        run.draft_tokens = int(c.get("vllm:spec_decode_num_draft_tokens", 0))
        run.accepted = int(c.get("vllm:spec_decode_num_accepted_tokens", 0))
        per_pos = c.get("vllm:spec_decode_num_accepted_tokens_per_pos")
        run.accepted_per_pos = [int(v) for v in per_pos] if isinstance(per_pos, list) else None
    return run


def decode(
    target: Path,
    prompt_sets: Sequence[Sequence[list[int]]],
    max_new: int,
    stop_ids: Iterable[int],
    drafter: Path | None = None,
    spec: DrafterSpec | None = None,
    dtype: str = "float32",
    tensor_parallel: int = 1,
) -> list[EngineRun]:
    """Greedy decoding of each set of token-id prompts in one vLLM engine (the offline API, no
    tokenizer: the ids are ours), with the drafter at `drafter` as DFlash when given; each
    set's spec-decode counters are its own."""
    from vllm import SamplingParams

    longest = max((len(p) for prompts in prompt_sets for p in prompts), default=1)
    max_len = longest + max_new + (spec.block_size if spec is not None else 0) + 8
    params = SamplingParams(temperature=0.0, max_tokens=max_new, stop_token_ids=sorted(stop_ids), detokenize=False)
    with runner_env(spec if drafter is not None else None, engine_device()):
        seqs = max((len(prompts) for prompts in prompt_sets), default=1)
        llm = open_engine(target, drafter, spec, dtype, max_len, tensor_parallel, seqs)
        try:
            runs = [_generate(llm, params, prompts, drafter is not None) for prompts in prompt_sets]
        finally:
            shut_down(llm)
            del llm
            gc.collect()
    return runs
