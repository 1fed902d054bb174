"""`dflash eval --engine vllm|llamacpp`: the same prompts, greedy, decoded by vLLM's offline
API or by llama.cpp's `llama-server` with the export as drafter, against the engine's own
plain greedy decoding and ours.

One `eval` record per prompt set, with `"engine": "vllm"`; `tau` is vLLM's, from its
spec-decode counters (1 + accepted draft tokens per verify step with a draft),
`acceptance_per_position` its accepted tokens per draft position over those steps,
`dflash_tau` our eval's on the same prompts (the two count the same thing: tokens per verify
step), and how many outputs equal vLLM's plain greedy output and ours. vLLM gets the prompts
as token ids (ours: the same chat template, options and stop tokens), so nothing differs
before decoding starts. Two vLLM engines run, one after the other (with the drafter, then
plain), each over every prompt set, before our decoding; a tiny target is saved for them to
a temporary folder, removed at the end. llama.cpp (`evaluate_in_llamacpp`) is the same with
two `llama-server`s, the target as GGUF and the drafter written to GGUF beside it; its
records say `"engine": "llamacpp"` and carry its tokens/s with and without the drafter.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config
from dflash.engines import vllm as engine_vllm
from dflash.errors import ConfigError
from dflash.eval.decode import greedy_generate
from dflash.eval.tally import DecodeSettings, evaluate
from dflash.model.drafter import DFlashDrafter, DrafterSpec, FrozenHead
from dflash.model.loading import model_folder
from dflash.model.target import Target
from dflash.serving import EngineRun, llamacpp, vllm

__all__ = [
    "check_llamacpp_drafter",
    "check_llamacpp_eval",
    "check_vllm_eval",
    "evaluate_in_llamacpp",
    "evaluate_in_vllm",
    "target_folder",
    "target_gguf",
]


def check_vllm_eval(cfg: Config) -> None:
    """What `--engine vllm` refuses before any model is loaded: a Python without vLLM, and a
    sampled eval (the outputs are checked against plain greedy decoding)."""
    _greedy_only(cfg.eval.temperature)
    engine_vllm.require_vllm()


def _greedy_only(temperature: float, engine: str = "vllm") -> None:
    if temperature > 0:
        msg = (
            f"--engine {engine}: greedy only (the outputs are checked against plain greedy decoding); "
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
    outputs: dict[str, list[list[int]]] | None = None,
) -> list[dict[str, Any]]:
    """The `eval` records of the export in vLLM, one per prompt set (name → token-id prompts;
    greedy only). `template_kwargs`: the chat template options the prompts were rendered with,
    kept in each record as our chat eval's are; `outputs`: filled with vLLM's speculative
    outputs per set (the next turn's context, `evaluate_engine_turns`). A target loaded
    without its decoder layers (`target.load = "head"`) has no decoding of ours to compare:
    `dflash_tau` and `identical_to_dflash_greedy` are null, `lossless` is vLLM's against itself."""
    _greedy_only(settings.temperature)
    why = vllm.problem(drafter.spec, target.head_dim, on_cpu=engine_vllm.engine_device() == "cpu")
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
        records.append({"prompt_set": name, **chat, **_record("vllm", spec_run, plain, ours, mine)})
        records[-1]["speculative_config"] = vllm.speculative_config(path, drafter.spec)
        if outputs is not None:
            outputs[name] = spec_run.outputs
    return records


def _record(
    engine: str, spec_run: EngineRun, plain: EngineRun, ours: list[list[int]] | None, mine: dict | None
) -> dict[str, Any]:
    """One prompt set's numbers: the engine's with the drafter, against its plain outputs and
    ours (None: no decoding of ours)."""
    per_pos = spec_run.accepted_per_pos or []
    steps = spec_run.drafts
    return {
        "engine": engine,
        "prompts": len(spec_run.outputs),
        "tau": round(spec_run.tau, 4),
        "verify_steps": steps,
        "accepted_tokens": spec_run.accepted,
        "accept_per_position": [round(a / steps, 4) if steps else 0.0 for a in per_pos],
        "dflash_tau": mine["tau"] if mine else None,
        "dflash_verify_steps": mine["verify_steps"] if mine else None,
        f"identical_to_{engine}_greedy": sum(a == b for a, b in zip(spec_run.outputs, plain.outputs, strict=True)),
        "identical_to_dflash_greedy": (
            None if ours is None else sum(a == b for a, b in zip(spec_run.outputs, ours, strict=True))
        ),
        # vLLM runs the weights dflash runs; llama.cpp may run a quantized GGUF: lossless against itself
        "lossless": spec_run.outputs == plain.outputs
        and (ours is None or engine == "llamacpp" or plain.outputs == ours),
        f"{engine}_tokens_per_s": _tokens_per_s(spec_run),
    }


def _tokens_per_s(run: EngineRun) -> float | None:
    if run.tokens_per_s is not None:  # the engine's own figure
        return run.tokens_per_s
    return round(sum(map(len, run.outputs)) / run.seconds, 1) if run.seconds else None


def check_llamacpp_eval(cfg: Config) -> None:
    """What `--engine llamacpp` refuses before any model is loaded: no build of llama.cpp
    here, a sampled eval, the tiny target (no vocabulary llama.cpp can load)."""
    _greedy_only(cfg.eval.temperature, "llamacpp")
    llamacpp.require_llamacpp()
    if cfg.target.kind == "tiny":
        msg = "--engine llamacpp: the tiny target has no vocabulary for llama.cpp; use an hf or gguf target"
        raise ConfigError(msg)


def check_llamacpp_drafter(spec: DrafterSpec, confidence: float) -> None:
    """What `--engine llamacpp` refuses once the drafter is read, before the target loads: a
    drafter reading the target's last layer (llama.cpp hooks layer inputs only), and a DSpark
    confidence threshold (llama.cpp cuts a draft at its first slot below `--spec-draft-p-min`,
    dflash at the product of the slots' confidences)."""
    last = spec.num_target_layers - 1
    if max(spec.target_layer_ids) >= last:
        msg = (
            f"--engine llamacpp: the drafter reads target layer {max(spec.target_layer_ids)}, the last; llama.cpp "
            f"hooks layer inputs only (layers 0-{last - 1})"
        )
        raise ConfigError(msg)
    if spec.family == "dspark" and confidence > 0:
        msg = (
            "--engine llamacpp: llama.cpp cuts a DSpark draft at its first slot below a threshold, dflash at the "
            "product of confidences; set drafter.dspark.confidence_threshold = 0 to compare the two"
        )
        raise ConfigError(msg)


def target_gguf(cfg: Config) -> Path:
    """The target as llama.cpp loads it: a `gguf` target's own file, an `hf` target converted
    once (float32, cached under data.cache_dir)."""
    from dflash.model.loading import cache_root, resolve_gguf

    assert cfg.target.path is not None
    if cfg.target.kind == "gguf":
        return resolve_gguf(cfg.target.path)
    folder = model_folder(cfg.target, cfg.data.cache_dir)
    return llamacpp.cached_hf_gguf(folder, cache_root(cfg.data.cache_dir))


def evaluate_in_llamacpp(
    cfg: Config,
    target: Target,
    drafter: DFlashDrafter,
    drafter_path: Path,
    sets: Mapping[str, Sequence[torch.Tensor]],
    settings: DecodeSettings,
    template_kwargs: dict[str, Any] | None = None,
    outputs: dict[str, list[list[int]]] | None = None,
) -> list[dict[str, Any]]:
    """The `eval` records of the drafter in llama-server, one per prompt set: the target's
    GGUF (`target_gguf`), the drafter written to GGUF beside it (a temporary file, f32), one
    server with the drafter, then one without, each over every prompt set, greedy; then ours.
    llama.cpp ends a generation at its own end-of-generation tokens, dflash at the stop ids:
    every output is compared up to the first of either (that token included)."""
    from dflash.model.export_gguf import read_target_gguf, write_gguf

    _greedy_only(settings.temperature, "llamacpp")
    t_gguf = target_gguf(cfg)
    ids = [[p.tolist() for p in prompts] for prompts in sets.values()]
    longest = max((len(p) for prompts in ids for p in prompts), default=0)
    ctx = longest + settings.max_new + drafter.spec.block_size + 16
    with tempfile.TemporaryDirectory(prefix="dflash-llamacpp-") as tmp:
        d_gguf = Path(tmp) / "drafter.gguf"
        write_gguf(drafter.spec, drafter.state_dict(), read_target_gguf(t_gguf), d_gguf, "f32")
        flags = llamacpp.spec_args(d_gguf, drafter.spec.family, drafter.spec.drafts)
        spec_runs = llamacpp.decode(t_gguf, ids, settings.max_new, flags, ctx=ctx)
    plain_runs = llamacpp.decode(t_gguf, ids, settings.max_new, ctx=ctx)
    ours_too = target.model is not None
    head = FrozenHead(target.embed_weight, target.lm_head_weight).to(target.device, torch.float32) if ours_too else None
    chat = {"turns": 1, "chat_template_kwargs": template_kwargs} if template_kwargs is not None else {}
    records = []
    for (name, prompts), spec_run, plain in zip(sets.items(), spec_runs, plain_runs, strict=True):
        ends = set(settings.stop_ids) | _eog(spec_run) | _eog(plain)
        ours, mine = None, None
        if ours_too:
            ours = [_upto(greedy_generate(target, p, settings.max_new, settings.stop_ids), ends) for p in prompts]
            mine = evaluate(target, drafter, head, prompts, settings)
        spec_run.outputs = [_upto(o, ends) for o in spec_run.outputs]
        plain.outputs = [_upto(o, ends) for o in plain.outputs]
        record = _record("llamacpp", spec_run, plain, ours, mine)
        record["llamacpp_plain_tokens_per_s"] = _tokens_per_s(plain)
        record["target_gguf"] = str(t_gguf)
        records.append({"prompt_set": name, **chat, **record})
        if outputs is not None:
            outputs[name] = spec_run.outputs
    return records


def _eog(run: EngineRun) -> set[int]:
    """The tokens llama.cpp ended a generation at (its end-of-generation tokens)."""
    return {out[-1] for out, why in zip(run.outputs, run.stops, strict=True) if why == "eos" and out}


def _upto(tokens: list[int], ends: set[int]) -> list[int]:
    """The tokens up to the first of `ends`, that one included."""
    for i, t in enumerate(tokens):
        if t in ends:
            return tokens[: i + 1]
    return tokens
