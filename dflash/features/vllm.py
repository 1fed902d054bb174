"""Target features from vLLM: `dflash features CONFIG --engine vllm`.

Training's first epoch runs the target over every sample to get its chosen layers' outputs.
This computes them ahead of time in vLLM instead (any tensor / pipeline parallelism vLLM
offers), and writes them to the feature store (`dflash/features/files.py`) beside each data
file (`data.jsonl` → `data.features/`): a run reads them from there and skips the target for
those samples, as it does with regen's.

How: the samples are tokenized exactly as training tokenizes them (`load_samples`, per data
file), deduplicated, and fed to vLLM's offline `LLM` as token-id prompts with
`max_tokens = 1`, under vLLM's `extract_hidden_states` speculative method and the
hidden-states connector (`hidden_states.py`), which writes each prompt's layers to a
scratch folder; they are read back, put in `target.layer_ids` order and written as parts.
Each entry also holds `next`, the target's greedy next token at every position (vLLM's
top-1 prompt logprob, then its one generated token), so `loss.labels = "target"` can use them.

Layer ids: ours are decoder layer i's output; vLLM's aux hidden state id j is the residual
stream *before* layer j (0: the embeddings), so ours i is vLLM's i + 1 — the last layer
included (vLLM takes it before the final norm, as our hooks do). vLLM returns them sorted.

A rerun skips samples already stored with the same target, dtype and layers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config
from dflash.engines.vllm import MAX_SEQS, engine_failed, kv_cache_bytes, shut_down
from dflash.errors import ConfigError, DFlashError
from dflash.features.files import Entry, FeatureMeta, FeatureStore, folder_for, ids_key, next_part_index, write_part

__all__ = [
    "EngineSettings",
    "extract_features",
    "generate_hidden",
    "read_hidden",
    "start_engine",
    "target_meta",
    "vllm_layer_ids",
]

CONNECTOR = "HiddenStatesConnector"
CONNECTOR_MODULE = "dflash.features.hidden_states"
# vLLM 0.32 checks the extract_hidden_states draft model (ExtractHiddenStatesModel, not SupportsPP)
# against the pipeline-parallel size too: SpeculativeConfig._verify_args -> verify_with_parallel_config.
PP_REFUSED = (
    "the 'model' it names is vLLM's ExtractHiddenStatesModel, the extract_hidden_states method's draft "
    "model, which does not support pipeline parallelism; use --tensor-parallel"
)

Seen = Callable[[list[int], torch.Tensor], None]  # (token ids, features (S, k·H) as vLLM gave them)


@dataclass(frozen=True)
class EngineSettings:
    """How vLLM runs: its parallelism, and how many prompt tokens go in one call (one part file)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    chunk_tokens: int = 65_536


def vllm_layer_ids(layer_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """vLLM's aux hidden state ids for our layer ids (sorted, once each), and where each of ours
    sits in what vLLM returns."""
    theirs = sorted({i + 1 for i in layer_ids})
    return theirs, [theirs.index(i + 1) for i in layer_ids]


def target_meta(cfg: Config) -> tuple[Path, FeatureMeta]:
    """The target's folder and the metadata training's target will have (its name, dtype on
    its device, layer ids as training resolves them, feature width)."""
    from dflash.model.drafter import default_target_layers
    from dflash.model.loading import model_config, model_folder
    from dflash.model.target import resolve_dtype

    if cfg.target.kind == "tiny":
        msg = "dflash features: needs a target in a folder (target.kind = 'hf' or 'gguf'), not the tiny one"
        raise ConfigError(msg)
    folder = model_folder(cfg.target, cfg.data.cache_dir)
    hf = model_config(folder).get_text_config()
    n_layers, hidden = int(hf.num_hidden_layers), int(hf.hidden_size)
    layer_ids = list(cfg.target.layer_ids or default_target_layers(n_layers, cfg.drafter.num_layers))
    if max(layer_ids) >= n_layers:
        msg = f"target.layer_ids: {layer_ids} out of range; the target has {n_layers} layers"
        raise ConfigError(msg)
    dtype = resolve_dtype(cfg.target.dtype, torch.device(cfg.pipeline.target_devices[0]))
    name = str(folder)  # what transformers records as the loaded model's _name_or_path
    return folder, FeatureMeta(name, str(dtype).removeprefix("torch."), layer_ids, len(layer_ids) * hidden, True)


def _file_samples(cfg: Config, tokenizer: Any) -> list[tuple[Path, list[torch.Tensor]]]:
    """Per data file: where its features go, and its samples' token ids as training has them
    (each distinct sequence once)."""
    from dflash.data.tokenize import load_samples
    from dflash.store.packages import local_path

    if cfg.data.source != "files":
        msg = f"dflash features: data.source = 'files' only (features of {cfg.data.source!r} data are not stored)"
        raise ConfigError(msg)
    out = []
    for file in cfg.data.files:
        one = cfg.data.model_copy(update={"files": [file.model_copy(update={"weight": 1.0})]})
        samples, _ = load_samples(one, tokenizer, progress=False)
        seen: set[bytes] = set()  # 16 bytes a sample; the ids stay views of the tokenized file
        distinct = []
        for s in samples:  # the first of each, in order
            key = ids_key(s.input_ids)
            if key not in seen:
                seen.add(key)
                distinct.append(s.input_ids)
        out.append((folder_for(local_path(file.path)), distinct))
    return out


def _stored(folder: Path, meta: FeatureMeta, max_len: int) -> FeatureStore | None:
    """The entries already in `folder` made the way `meta` says (greedy: ours carry `next`);
    `max_len`: data.max_seq_len, as training indexes the folder (a sample cut there is served
    by a longer stored entry)."""
    return FeatureStore([folder], meta, 1, max_len, []) if folder.is_dir() else None


def _chunks(todo: list[torch.Tensor], budget: int) -> Iterator[list[list[int]]]:
    """`todo` in runs of at most `budget` tokens (one prompt at least), as lists of ids."""
    chunk: list[list[int]] = []
    used = 0
    for ids in todo:
        if chunk and used + len(ids) > budget:
            yield chunk
            chunk, used = [], 0
        chunk.append(ids.tolist())
        used += len(ids)
    if chunk:
        yield chunk


def start_engine(folder: Path, meta: FeatureMeta, scratch: Path, settings: EngineSettings, max_len: int) -> Any:
    """vLLM's offline engine on the target, keeping the chosen layers of every prompt."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries our JSON records only
    from vllm import LLM
    from vllm.platforms import current_platform

    aux, _ = vllm_layer_ids(meta.layer_ids)
    spec = {
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}},
    }  # fmt: skip
    kv = {
        "kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(scratch)},
    }  # fmt: skip
    kv_bytes = kv_cache_bytes(folder, meta.dtype, MAX_SEQS, max_len, None,
                              settings.tensor_parallel * settings.pipeline_parallel, settings.chunk_tokens)  # fmt: skip
    sized = {"kv_cache_memory_bytes": kv_bytes} if kv_bytes is not None else {}
    try:
        return LLM(
            model=str(folder), skip_tokenizer_init=True, dtype=meta.dtype, max_model_len=max_len, seed=0,
            tensor_parallel_size=settings.tensor_parallel, pipeline_parallel_size=settings.pipeline_parallel,
            enforce_eager=current_platform.is_cpu(), speculative_config=spec, kv_transfer_config=kv, **sized,
        )  # fmt: skip
    except NotImplementedError as err:  # what vLLM refuses for this method, e.g. pipeline parallelism
        why = " ".join(str(err).split())
        if settings.pipeline_parallel > 1:
            why += f" ({PP_REFUSED})"
        raise ConfigError(f"dflash features: vLLM cannot extract hidden states this way: {why}") from None
    except RuntimeError as err:  # after NotImplementedError, one of its kind
        raise engine_failed(err, kv_bytes) from None


def _greedy_next(out: Any) -> torch.Tensor:
    """The target's greedy next token at every prompt position: vLLM's top-1 prompt logprob at
    the following position, and at the last one the token it generated."""
    ranked = [next(t for t, lp in d.items() if lp.rank == 1) for d in out.prompt_logprobs[1:]]
    return torch.tensor([*ranked, out.outputs[0].token_ids[0]], dtype=torch.int64)


def _run_chunk(llm: Any, prompts: list[list[int]], order: list[int], seen: Seen | None) -> list[Entry]:
    """One vLLM call over `prompts`: an entry each, its layers in `target.layer_ids` order."""
    return read_hidden(generate_hidden(llm, prompts), prompts, order, seen)


def generate_hidden(llm: Any, prompts: list[list[int]]) -> list[Any]:
    """One vLLM call over `prompts` (greedy, one new token, the prompts' top-1 logprobs): its
    outputs, each naming the file the connector wrote the prompt's hidden states to."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def read_hidden(outs: list[Any], prompts: list[list[int]], order: list[int], seen: Seen | None) -> list[Entry]:
    """The files of a call's outputs, read and deleted: an entry each, its layers in
    `target.layer_ids` order (`order`), its greedy next tokens."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    entries = []
    for ids, out in zip(prompts, outs, strict=True):
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            msg = "vLLM returned no hidden states (is the extract_hidden_states method running?)"
            raise DFlashError(msg)
        data = load_hidden_states(path)
        cleanup_hidden_states(path)
        hidden = data["hidden_states"]  # (S, k, H), vLLM's layer order
        if data["token_ids"].tolist() != ids or hidden.shape[0] != len(ids):
            msg = f"vLLM's hidden states at {path} are not those of the prompt sent ({hidden.shape[0]} positions)"
            raise DFlashError(msg)
        features = hidden[:, order].reshape(len(ids), -1)
        if seen is not None:
            seen(ids, features)
        entries.append(Entry(torch.tensor(ids, dtype=torch.int64), features, _greedy_next(out)))
    return entries


def extract_features(cfg: Config, settings: EngineSettings, seen: Seen | None = None) -> dict[str, Any]:
    """Feature files beside every data file, from vLLM; returns the counts of the `features`
    record. `seen`: called with each entry's token ids and features as vLLM gave them."""
    from dflash.model.loading import load_tokenizer

    t0 = time.perf_counter()
    folder, meta = target_meta(cfg)
    per_file = _file_samples(cfg, load_tokenizer(cfg.target, cfg.data.cache_dir))
    todo = []
    for out, samples in per_file:
        have = _stored(out, meta, cfg.data.max_seq_len)
        todo.append((out, [ids for ids in samples if have is None or have.find(ids) is None]))
    stats: dict[str, Any] = {
        "engine": "vllm", "target": meta.target, "dtype": meta.dtype, "layer_ids": meta.layer_ids,
        "samples": sum(len(s) for _, s in per_file), "already_stored": 0, "written": 0, "tokens": 0, "parts": 0,
        "folders": sorted({str(out) for out, _ in per_file}),
    }  # fmt: skip
    stats["already_stored"] = stats["samples"] - sum(len(t) for _, t in todo)
    longest = max((len(ids) for _, t in todo for ids in t), default=0)
    if longest:
        scratch = Path(tempfile.mkdtemp(prefix="dflash-vllm-hidden-states-"))  # vLLM's files, each read once
        llm = None
        try:
            llm = start_engine(folder, meta, scratch, settings, longest + 8)
            for out, prompts in todo:
                _write_file(llm, out, prompts, meta, settings, seen, stats)
        finally:
            if llm is not None:  # now, not at interpreter exit, where vLLM's teardown can abort the process
                shut_down(llm)
            shutil.rmtree(scratch, ignore_errors=True)
    stats["wall_s"] = round(time.perf_counter() - t0, 2)
    return stats


def _write_file(
    llm: Any,
    out: Path,
    prompts: list[torch.Tensor],
    meta: FeatureMeta,
    settings: EngineSettings,
    seen: Seen | None,
    stats: dict[str, Any],
) -> None:
    """One data file's prompts through the engine: a part in `out` per chunk, written as it is done."""
    _, order = vllm_layer_ids(meta.layer_ids)
    index = next_part_index(out)
    for chunk in _chunks(prompts, settings.chunk_tokens):
        write_part(out, index, _run_chunk(llm, chunk, order, seen), meta)
        index += 1
        stats["parts"] += 1
        stats["written"] += len(chunk)
        stats["tokens"] += sum(map(len, chunk))
