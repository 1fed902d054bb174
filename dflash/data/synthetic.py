"""Synthetic self-distillation data: random prompts, continued by the target's greedy output.

This is how production drafters are trained (the target writes the responses), in
miniature: the loss mask covers the generated tokens only, so a drafter that learns to
predict them is learning the target's own continuations — and speculative decoding with
that target will accept its proposals.
"""

from __future__ import annotations

import torch

from dflash.config import DataConfig
from dflash.data.samples import Sample
from dflash.model.hf_compat import cache_kwarg, output_cache
from dflash.model.target import Target

__all__ = ["draw_prompts", "random_samples", "synthesize"]


@torch.no_grad()
def _greedy(target: Target, prompts: torch.Tensor, n: int) -> torch.Tensor:
    model = target.model
    key = cache_kwarg(model)
    out = model(input_ids=prompts, use_cache=True)
    nxt = out.logits[:, -1].argmax(dim=-1)
    gen = [nxt]
    for _ in range(n - 1):
        out = model(input_ids=nxt[:, None], use_cache=True, **{key: output_cache(out)})
        nxt = out.logits[:, -1].argmax(dim=-1)
        gen.append(nxt)
    return torch.stack(gen, dim=1)


def _id_limit(vocab: int, exclude_token: int | None) -> int:
    """Random ids are drawn below this: the tiny target's mask token (the vocabulary's last
    id) never appears in the data."""
    return vocab - 1 if exclude_token == vocab - 1 else vocab


def _prompt_then_reply(sample_id: int, prompt: torch.Tensor, reply: torch.Tensor) -> Sample:
    """One sample: the prompt carries no loss, the reply does."""
    mask = torch.cat([torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(reply.numel(), dtype=torch.bool)])
    return Sample(sample_id=sample_id, input_ids=torch.cat([prompt, reply]), loss_mask=mask)


def draw_prompts(cfg: DataConfig, vocab: int, n: int, seed: int, exclude_token: int | None) -> list[torch.Tensor]:
    """`n` random prompts of prompt_len/2..prompt_len tokens, never containing `exclude_token`
    when it is the last id of the vocabulary (the tiny target's mask token)."""
    g = torch.Generator().manual_seed(seed)
    lo = max(1, cfg.prompt_len // 2)
    lengths = torch.randint(lo, cfg.prompt_len + 1, (n,), generator=g)
    return [torch.randint(0, _id_limit(vocab, exclude_token), (int(k),), generator=g) for k in lengths]


def synthesize(cfg: DataConfig, target: Target, seed: int, exclude_token: int | None) -> list[Sample]:
    """`cfg.num_samples` samples: a random prompt (loss mask 0), then `gen_len` greedy
    target tokens (loss mask 1)."""
    prompts = draw_prompts(cfg, target.vocab_size, cfg.num_samples, seed + 7919, exclude_token)
    lengths = [p.numel() for p in prompts]
    samples: list[Sample | None] = [None] * cfg.num_samples
    dev = target.device
    chunk = 64
    for length in sorted(set(lengths)):
        idx = [i for i, n in enumerate(lengths) if n == length]
        for s in range(0, len(idx), chunk):
            part = idx[s : s + chunk]
            p = torch.stack([prompts[i] for i in part]).to(dev)
            cont = _greedy(target, p, cfg.gen_len).cpu()
            for row, i in enumerate(part):
                samples[i] = _prompt_then_reply(i, prompts[i], cont[row])
    return [s for s in samples if s is not None]


def random_samples(cfg: DataConfig, vocab: int, seed: int, exclude_token: int | None) -> list[Sample]:
    """`cfg.num_samples` samples of random ids: a prompt (loss mask 0), then `gen_len`
    random tokens (loss mask 1). No target runs: for throughput benchmarks of real-size
    targets, where generating the data would take longer than the measurement."""
    prompts = draw_prompts(cfg, vocab, cfg.num_samples, seed + 7919, exclude_token)
    g = torch.Generator().manual_seed(seed + 15_485_863)
    high = _id_limit(vocab, exclude_token)
    return [
        _prompt_then_reply(i, p, torch.randint(0, high, (cfg.gen_len,), generator=g)) for i, p in enumerate(prompts)
    ]
