"""The `eval` record: a drafter's speculative decoding over prompts, against the target's
own decoding of the same prompts, summed into τ, acceptance per verify step and per
position, speed, and the lossless check.

`evaluate` takes token-id prompts; `evaluate_chat` takes chat prompts turn by turn (each
turn after the target's reply to the one before). Both decode as `DecodeSettings` says:
greedy or sampled, one prompt at a time or (greedy) in batches. `DecodeSettings.should_stop`
ends an eval early (`EvalStopped`, raised out of the decoding step that saw it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash.config import Config
from dflash.data.chat_template import prompt_ids
from dflash.eval.decode import (
    Sampling,
    SpecOutput,
    greedy_generate,
    greedy_generate_batch,
    speculative_generate,
    speculative_generate_batch,
)
from dflash.eval.prompts import Turns
from dflash.model.drafter import DFlashDrafter, FrozenHead
from dflash.model.hf_compat import plain_kv_cache
from dflash.model.target import Target

__all__ = ["DecodeSettings", "evaluate", "evaluate_chat"]


@dataclass(frozen=True)
class DecodeSettings:
    """How eval decodes: at most `max_new` tokens a generation, ending at any of `stop_ids`;
    greedy at temperature 0, else sampled from `seed`; `batch_size` prompts at once (greedy
    only: a sampled eval decodes one prompt at a time). `should_stop`, asked once per decoding
    step: True ends the eval there (`EvalStopped`)."""

    max_new: int
    stop_ids: frozenset[int] = frozenset()
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 1
    should_stop: Callable[[], bool] | None = field(default=None, compare=False)
    confidence: float = 0.0  # DSpark: drafter.dspark.confidence_threshold
    family_head: bool = True  # eval.family_head

    @classmethod
    def of(cls, cfg: Config, stop_ids: Iterable[int], should_stop: Callable[[], bool] | None = None) -> DecodeSettings:
        """The settings a config gives (`[eval]`, and `run.seed`), ending at `stop_ids`."""
        e = cfg.eval
        # decoding applies the confidence cut to DSpark drafters only, and as part of its head
        conf = cfg.drafter.dspark.confidence_threshold if e.family_head else 0.0
        return cls(
            e.max_new_tokens, frozenset(stop_ids), e.temperature, cfg.run.seed, e.batch_size, should_stop, conf,
            e.family_head,
        )  # fmt: skip


class _Tally:
    """What the `eval` record reports, summed over generations."""

    def __init__(
        self, block_size: int, temperature: float = 0.0, batch_size: int = 1, drafts: int = 0, family_head: bool = True
    ) -> None:
        self.B = block_size
        self.family_head = family_head
        self.span = (drafts or block_size - 1) + 1  # a verify step's tokens: the drafts and the target's own
        self.temperature = temperature
        self.batch_size = batch_size if temperature <= 0 else 1
        self.largest_batch = 1  # the most prompts decoded at once
        self.singly = 0  # batched rows whose outputs differed, decided again one prompt at a time
        self.hist = [0] * self.span
        self.spec_s = self.plain_s = 0.0
        self.mismatches = self.generated = 0
        self.per_generation: list[float] = []  # each generation's own τ
        self.turn = 0  # the turn depth being decoded (0: the first turn of each prompt)
        self.per_turn: dict[int, list[int]] = {}  # turn -> [verify steps, tokens they gave]

    def add(self, spec: SpecOutput, plain: list[int], spec_s: float, plain_s: float) -> None:
        self.spec_s += spec_s
        self.plain_s += plain_s
        self.generated += len(spec.tokens)
        self.mismatches += self.temperature <= 0 and spec.tokens != plain
        for a in spec.accepted:
            self.hist[a] += 1
        steps = self.per_turn.setdefault(self.turn, [0, 0])
        steps[0] += len(spec.accepted)
        steps[1] += sum(a + 1 for a in spec.accepted)
        if spec.accepted:
            self.per_generation.append(sum(a + 1 for a in spec.accepted) / len(spec.accepted))

    def record(self, prompts: int) -> dict[str, Any]:
        hist, steps = self.hist, sum(self.hist)
        tau = sum((a + 1) * n for a, n in enumerate(hist)) / steps if steps else 0.0
        per_position = [sum(hist[k:]) / steps if steps else 0.0 for k in range(1, self.span)]
        gens = self.per_generation
        return {
            "tau": round(tau, 4),
            # the reference benchmark's "average acceptance length": the mean of each generation's τ
            "tau_per_generation": round(sum(gens) / len(gens), 4) if gens else 0.0,
            "accept_hist": hist,
            "accept_per_position": [round(x, 4) for x in per_position],
            "verify_steps": steps,
            "prompts": prompts,
            "generations": len(gens),
            "tokens": self.generated,
            "spec_s": round(self.spec_s, 4),
            "plain_s": round(self.plain_s, 4),
            # at batch_size > 1: batched speculative decoding against batched plain decoding
            "speedup": round(self.plain_s / self.spec_s, 3) if self.spec_s > 0 else None,
            "batch_size": self.largest_batch,
            "decided_singly": self.singly,
            # sampled: outputs differ from a plain sample by chance; exactness is in distribution
            "lossless": self.mismatches == 0 if self.temperature <= 0 else None,
            "mismatched_prompts": self.mismatches,
            "block_size": self.B,
            "temperature": self.temperature,
            "family_head": self.family_head,  # False: drafted from the backbone's logits alone (eval.family_head)
            # τ of each turn depth (turn 1, 2, ... of multi-turn prompts: MT-Bench's second turns apart)
            "tau_per_turn": [
                round(n / k, 4) if k else 0.0 for k, n in (self.per_turn[t] for t in sorted(self.per_turn))
            ],
        }


@contextlib.contextmanager
def _eval_mode(drafter: DFlashDrafter) -> Iterator[None]:
    """The drafter in eval mode for the block, then back to what it was (training)."""
    was_training = drafter.training
    drafter.eval()
    try:
        yield
    finally:
        drafter.train(was_training)


class _Evaluation:
    """One eval's models and settings, its running tally, and the generator its samples draw from."""

    def __init__(self, target: Target, drafter: DFlashDrafter, head: FrozenHead, settings: DecodeSettings) -> None:
        self.target, self.drafter, self.head, self.settings = target, drafter, head, settings
        spec = drafter.spec
        s = settings
        self.tally = _Tally(spec.block_size, s.temperature, s.batch_size, spec.drafts, s.family_head)
        self.generator = torch.Generator().manual_seed(settings.seed)

    def one(self, prompt: torch.Tensor) -> SpecOutput:
        """One speculative generation and the plain one (greedy: it must equal it), both timed."""
        s = self.settings
        sampling = Sampling(self.tally.temperature, self.generator, s.confidence, s.family_head)
        t0 = time.perf_counter()
        models = (self.target, self.drafter, self.head)
        spec = speculative_generate(*models, prompt, s.max_new, s.stop_ids, sampling, s.should_stop)
        t1 = time.perf_counter()
        plain = greedy_generate(self.target, prompt, s.max_new, s.stop_ids, sampling, s.should_stop)
        self.tally.add(spec, plain, t1 - t0, time.perf_counter() - t1)
        return spec

    def many(self, prompts: Sequence[torch.Tensor]) -> list[SpecOutput]:
        """`one` for each prompt, or (greedy, `tally.batch_size` > 1) batches of them (`batch`)."""
        size = self.tally.batch_size
        if size <= 1 or not plain_kv_cache(self.target.model):  # a sliding window counts hidden slots
            return [self.one(p) for p in prompts]
        return [spec for s in range(0, len(prompts), size) for spec in self.batch(prompts[s : s + size])]

    def batch(self, chunk: Sequence[torch.Tensor]) -> list[SpecOutput]:
        """Batched speculative decoding, then batched plain decoding, each batch's time shared by
        its rows. A row whose two outputs differ is decided one prompt at a time, as batch size 1
        decides it: a batched matmul can round a near-tie the other way, and only a mismatch
        there counts."""
        s, models = self.settings, (self.target, self.drafter, self.head)
        self.tally.largest_batch = max(self.tally.largest_batch, len(chunk))
        t0 = time.perf_counter()
        specs = speculative_generate_batch(
            *models, chunk, s.max_new, s.stop_ids, s.should_stop, s.confidence, s.family_head
        )
        t1 = time.perf_counter()
        plains = greedy_generate_batch(self.target, chunk, s.max_new, s.stop_ids, s.should_stop)
        t2 = time.perf_counter()
        outs = []
        for p, spec, plain in zip(chunk, specs, plains, strict=True):
            if spec.tokens != plain:
                self.tally.singly += 1
                again = Sampling(confidence=s.confidence, family_head=s.family_head)
                spec = speculative_generate(*models, p, s.max_new, s.stop_ids, again, s.should_stop)
                plain = greedy_generate(self.target, p, s.max_new, s.stop_ids, should_stop=s.should_stop)
            self.tally.add(spec, plain, (t1 - t0) / len(chunk), (t2 - t1) / len(chunk))
            outs.append(spec)
        return outs


def evaluate(
    target: Target, drafter: DFlashDrafter, head: FrozenHead, prompts: Sequence[torch.Tensor], settings: DecodeSettings
) -> dict[str, Any]:
    """The `eval` record over token-id prompts: τ, acceptance histogram / per position,
    speed, lossless (greedy; with a temperature, sampled: exact in distribution).
    `settings.batch_size` > 1 (greedy only): that many prompts decoded at once."""
    run = _Evaluation(target, drafter, head, settings)
    with _eval_mode(drafter):
        run.many(prompts)
    return run.tally.record(len(prompts))


def evaluate_chat(
    target: Target,
    drafter: DFlashDrafter,
    head: FrozenHead,
    tokenizer: Any,
    prompts: Sequence[Turns],
    settings: DecodeSettings,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `eval` record over chat prompts (`data.prompt_sets`): each prompt's turns in
    order, each through the chat template after the target's reply to the one before (the
    speculative output, which equals the plain one when lossless), as the reference's
    benchmark does for MT-Bench. With `settings.batch_size` > 1, turn k of every prompt that
    has one is decoded in batches, after every prompt's turn k - 1."""
    run = _Evaluation(target, drafter, head, settings)
    histories: list[list[dict[str, str]]] = [[] for _ in prompts]
    # One prompt after another (a sampled eval draws in the same order at any --num-prompts), or
    # with batches every prompt's turn k, then every turn k + 1.
    everyone = [list(range(len(prompts)))] if prompts else []
    groups = [[i] for i in range(len(prompts))] if run.tally.batch_size <= 1 else everyone
    with _eval_mode(drafter):
        for group, k in ((g, k) for g in groups for k in range(max(len(prompts[i]) for i in g))):
            rows = [i for i in group if k < len(prompts[i])]
            run.tally.turn = k
            ids = []
            for i in rows:
                histories[i] = [*histories[i], *prompts[i][k]]
                ids.append(torch.tensor(prompt_ids(tokenizer, histories[i], template_kwargs), dtype=torch.long))
            for i, spec in zip(rows, run.many(ids), strict=True):
                reply = tokenizer.decode(spec.tokens, skip_special_tokens=True)
                histories[i] = [*histories[i], {"role": "assistant", "content": reply}]
    return run.tally.record(len(prompts))
