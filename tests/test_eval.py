"""Speculative decoding: the cached inference path equals training, and eval is lossless."""

from __future__ import annotations

import pytest
import torch

from dflash.config import load_config
from dflash.data.synthetic import draw_prompts
from dflash.errors import CheckpointError
from dflash.eval.decode import Sampling, greedy_generate, inference_masks, speculative_generate
from dflash.eval.fit import check_drafter_fits
from dflash.eval.tally import DecodeSettings, evaluate
from dflash.model.drafter import DFlashDrafter, DrafterCache, DrafterSpec, FrozenHead
from dflash.model.masks import BlockLayout, layer_masks
from dflash.model.target import load_target
from tests.conftest import ROOT, run_records


def _spec(**kw: object) -> DrafterSpec:
    base = dict(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
        vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=[0, 1],
        num_target_layers=2, block_size=4, mask_token_id=63,
        layer_types=["full_attention", "sliding_attention"], sliding_window=5,
    )  # fmt: skip
    base.update(kw)
    return DrafterSpec(**base)  # type: ignore[arg-type]


def test_cached_block_forward_equals_training_forward():
    """Inference (cached context K/V, one block) gives the training forward's outputs."""
    torch.manual_seed(0)
    spec = _spec()
    d = DFlashDrafter(spec)
    d.init_weights(torch.Generator().manual_seed(1))
    S, B = 9, spec.block_size
    feats = torch.randn(1, S, 2 * spec.hidden_size)
    emb = torch.randn(1, B, spec.hidden_size)
    # Training layout: one block anchored at S; the context includes a dummy slot at S.
    ctx = torch.cat([feats, torch.randn(1, 1, 2 * spec.hidden_size)], dim=1)
    layout = BlockLayout(
        torch.tensor([[S]]), torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, S + 1, dtype=torch.long), B
    )
    masks = layer_masks(layout, spec, use_flex=False)
    q_pos = torch.arange(S, S + B)[None]
    want = d(emb, ctx, q_pos, torch.arange(S + 1)[None], masks)
    cache = DrafterCache(spec.num_layers)
    d.extend_context(cache, feats[:, :4], torch.arange(4)[None])  # in two pieces, as decoding does
    d.extend_context(cache, feats[:, 4:], torch.arange(4, S)[None])
    got = d.forward_block(cache, emb, q_pos, inference_masks(d, S, B, torch.device("cpu")))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _tiny_target():
    cfg = load_config(ROOT / "configs" / "tiny.toml")
    return cfg, load_target(cfg.target, torch.device("cpu"), 1)


def test_untrained_drafter_is_lossless_with_tau_near_one():
    """An untrained drafter is accepted almost never (τ ≈ 1), and the output is still exact."""
    cfg, t = _tiny_target()
    spec = _spec(
        hidden_size=t.hidden_size, num_layers=1, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, intermediate_size=t.intermediate_size, vocab_size=t.vocab_size,
        target_layer_ids=t.layer_ids, num_target_layers=t.num_layers, block_size=8,
        mask_token_id=t.vocab_size - 1, layer_types=["full_attention"],
    )  # fmt: skip
    d = DFlashDrafter(spec)
    d.init_weights(torch.Generator().manual_seed(0))
    head = FrozenHead(t.embed_weight, t.lm_head_weight)
    prompts = draw_prompts(cfg.data, t.vocab_size, 3, 99, spec.mask_token_id)
    rec = evaluate(t, d, head, prompts, DecodeSettings(24))
    assert rec["lossless"] is True
    assert 1.0 <= rec["tau"] < 1.2
    assert rec["tokens"] == 3 * 24
    assert sum(rec["accept_hist"]) == rec["verify_steps"]


class _RecordingDrafter(DFlashDrafter):
    """A drafter that keeps every context it is given: (positions (S,), features (S, k·H))."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__(spec)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def extend_context(self, cache: DrafterCache, feats: torch.Tensor, positions: torch.Tensor) -> None:
        self.seen.append((positions[0], feats[0]))
        super().extend_context(cache, feats, positions)


def test_eval_reads_the_features_training_captures():
    """For every layer of the tiny target, the last one included (HF's last hidden_states
    entry has the final norm applied; a decoder layer's output does not), the features
    speculative decoding gives the drafter, prefill and verify steps, equal what training's
    `Target.capture` gives for the same tokens at the same positions."""
    cfg = load_config(ROOT / "configs" / "tiny.toml")
    every = list(range(cfg.target.tiny.num_layers))
    t = load_target(cfg.target.model_copy(update={"layer_ids": every}), torch.device("cpu"), 1)
    spec = _spec(
        hidden_size=t.hidden_size, num_layers=1, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, intermediate_size=t.intermediate_size, vocab_size=t.vocab_size,
        target_layer_ids=every, num_target_layers=t.num_layers, block_size=4,
        mask_token_id=t.vocab_size - 1, layer_types=["full_attention"],
    )  # fmt: skip
    d = _RecordingDrafter(spec)
    d.init_weights(torch.Generator().manual_seed(0))
    prompt = draw_prompts(cfg.data, t.vocab_size, 1, 7, spec.mask_token_id)[0]
    out = speculative_generate(t, d, FrozenHead(t.embed_weight, t.lm_head_weight), prompt, 12, set())
    ids = torch.cat([prompt, torch.tensor(out.tokens)])[None]  # (1, T): prompt + everything generated
    T = ids.shape[1]
    want = torch.cat(t.capture(ids, torch.zeros_like(ids), torch.arange(T)[None]), dim=-1)[0]  # (T, L·H)
    assert len(d.seen) > 1  # the prefill and at least one verify step
    for pos, feats in d.seen:
        torch.testing.assert_close(feats, want[pos], atol=1e-4, rtol=1e-4)


def test_a_drafter_for_another_target_is_refused():
    """`dflash eval` refuses a drafter whose hidden size, vocabulary or target depth differ."""
    _, t = _tiny_target()
    fits = dict(hidden_size=t.hidden_size, vocab_size=t.vocab_size, num_target_layers=t.num_layers)
    check_drafter_fits(DFlashDrafter(_spec(**fits)), t)
    with pytest.raises(CheckpointError, match=r"does not fit this target: vocab size 64 vs target 512; trained on"):
        check_drafter_fits(DFlashDrafter(_spec(**{**fits, "vocab_size": 64, "num_target_layers": 9})), t)


def test_greedy_generation_stops_at_a_stop_id():
    """Plain greedy decoding (the lossless reference) ends at, and includes, the first stop id."""
    cfg, t = _tiny_target()
    prompts = draw_prompts(cfg.data, t.vocab_size, 2, 7, t.vocab_size - 1)
    plain = greedy_generate(t, prompts[0], 20, set())
    stop = {plain[5]}
    stopped = greedy_generate(t, prompts[0], 20, stop)
    assert stopped == plain[: plain.index(plain[5]) + 1]


def test_training_raises_tau_and_eval_is_lossless(tiny_config):
    """Training on the tiny config raises tau_sim over step 1, and the trained drafter's
    speculative decoding is lossless with τ above the untrained ~1."""
    cfg = tiny_config(
        **{"data.num_samples": 256, "train.epochs": 4, "optimizer.lr": 2e-2, "eval.num_prompts": 3,
           "eval.max_new_tokens": 32, "eval.at_end": "true"}
    )  # fmt: skip
    records = run_records(cfg)
    steps = [r for r in records if r["event"] == "train_step"]
    early = sum(s["tau_sim"] for s in steps[:5]) / 5
    late = sum(s["tau_sim"] for s in steps[-5:]) / 5
    assert late > early + 0.2, (early, late)
    ev = [r for r in records if r["event"] == "eval"]
    assert len(ev) == 1 and ev[0]["lossless"] is True
    assert ev[0]["tau"] > 1.2, ev[0]


def test_periodic_eval_during_training(tiny_config):
    """eval.every_steps = 2 emits an eval record after steps 2 and 4, between steps."""
    cfg = tiny_config(
        **{"train.max_steps": 4, "eval.every_steps": 2, "eval.at_end": "false", "eval.num_prompts": 1,
           "eval.max_new_tokens": 8}
    )  # fmt: skip
    records = run_records(cfg)
    evals = [r for r in records if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["lossless"] for e in evals)


class _OracleDrafter(DFlashDrafter):
    """Proposes exactly the target's greedy continuation `plain` (so every block is accepted
    whole): slot i's hidden state is the basis vector e_i, and the head's LM matrix is
    rewritten per block to map e_i to the wanted token."""

    def __init__(self, spec: DrafterSpec, head: FrozenHead, plain: list[int], prompt_len: int) -> None:
        super().__init__(spec)
        self.head, self.plain, self.P = head, plain, prompt_len

    def forward_block(self, cache, emb, q_pos, masks):  # type: ignore[no-untyped-def]
        start, bs = int(q_pos[0, 0]), q_pos.shape[1]
        h = torch.zeros(1, bs, self.spec.hidden_size)
        self.head.lm_head.zero_()
        for i in range(1, bs):
            k = start + i - self.P  # index in `plain` of the token slot i predicts
            self.head.lm_head[self.plain[k] if k < len(self.plain) else 0, i - 1] = 1.0
            h[0, i, i - 1] = 1.0
        return h


def test_a_stop_id_accepted_inside_a_block_ends_generation_there():
    """The reference stops as soon as a stop id is among the accepted tokens: one verify
    step here, not one per remaining token."""
    cfg, t = _tiny_target()
    spec = _spec(
        hidden_size=t.hidden_size, num_layers=1, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, intermediate_size=t.intermediate_size, vocab_size=t.vocab_size,
        target_layer_ids=t.layer_ids, num_target_layers=t.num_layers, block_size=8,
        mask_token_id=t.vocab_size - 1, layer_types=["full_attention"],
    )  # fmt: skip
    prompt = draw_prompts(cfg.data, t.vocab_size, 1, 5, spec.mask_token_id)[0]
    plain = greedy_generate(t, prompt, 32, set())
    k = next(i for i in range(2, 6) if plain[i] not in plain[:i])  # first occurrence, inside block 1
    head = FrozenHead(t.embed_weight.clone(), t.lm_head_weight.clone())
    d = _OracleDrafter(spec, head, plain, prompt.numel())
    d.init_weights(torch.Generator().manual_seed(0))
    free = speculative_generate(t, d, head, prompt, 32, set())
    assert free.tokens == plain and free.accepted[0] == 7  # the oracle is accepted whole
    out = speculative_generate(t, d, head, prompt, 32, {plain[k]})
    assert out.tokens == plain[: k + 1]
    assert out.accepted == [7], "steps after the stop token were counted"


def test_speculative_sampling_verification_is_exact_in_distribution():
    """The verification rule alone (`verify_sampled`), on fixed distributions: the first
    token it emits — the drafted one when accepted, else the draw from max(0, p - q) — is
    distributed as the target's p, whatever the drafter's q."""
    from dflash.eval.decode import verify_sampled

    g = torch.Generator().manual_seed(0)
    V, n = 6, 30_000
    p = torch.softmax(torch.randn(2, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 2, -1)
    counts = torch.zeros(V)
    accepted = 0
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        acc, nxt = verify_sampled([x], q, p, g)
        counts[x if acc == 1 else nxt] += 1
        accepted += acc
    assert 0.1 * n < accepted < 0.9 * n
    assert 0.5 * (counts / n - p[0]).abs().sum() < 0.015, (counts / n, p[0])
    # the rule is what makes it exact: the drafter's own samples are far from p
    assert 0.5 * (q[0] - p[0]).abs().sum() > 0.2


def test_sampled_speculative_decoding_follows_the_target_distribution():
    """End to end with real models, temperature 1: the first two tokens (the second drafted,
    verified) follow the target's joint p(t1) p(t2 | t1), computed exactly; the drafter reads
    a flattened LM head, so its proposals are often wrong and sometimes right."""
    V, scale = 16, 60.0
    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"target.tiny.vocab_size={V}"])
    t = load_target(cfg.target, torch.device("cpu"), 1)
    with torch.no_grad():
        t.model.lm_head.weight.mul_(scale)  # a peaked target distribution
    spec = _spec(
        hidden_size=t.hidden_size, num_layers=1, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, intermediate_size=t.intermediate_size, vocab_size=V,
        target_layer_ids=t.layer_ids, num_target_layers=t.num_layers, block_size=4,
        mask_token_id=V - 1, layer_types=["full_attention"],
    )  # fmt: skip
    d = DFlashDrafter(spec)
    d.init_weights(torch.Generator().manual_seed(3))
    head = FrozenHead(t.embed_weight, t.lm_head_weight / scale)
    prompt = torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        p1 = torch.softmax(t.model(input_ids=prompt[None]).logits[0, -1], -1)
        exact = torch.stack([
            p1[a] * torch.softmax(t.model(input_ids=torch.cat([prompt, torch.tensor([a])])[None]).logits[0, -1], -1)
            for a in range(V)
        ])  # fmt: skip
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V)
    n, rejected = 400, 0
    for _ in range(n):
        out = speculative_generate(t, d, head, prompt, 2, set(), Sampling(1.0, g))
        counts[out.tokens[0], out.tokens[1]] += 1
        rejected += out.accepted == [0]
    assert 0.1 * n < rejected < 0.95 * n, rejected
    assert 0.5 * (counts / n - exact).abs().sum() < 0.1


class _PartialOracle(DFlashDrafter):
    """Proposes each row's target continuation except at every fifth position (a wrong
    token there): partial acceptance, the same on one row or in a batch (`rows`: each batch
    row's prompt length and greedy continuation)."""

    def __init__(self, spec: DrafterSpec, head: FrozenHead, rows: list[tuple[int, list[int]]]) -> None:
        super().__init__(spec)
        self.head, self.rows = head, rows  # (prompt length, greedy continuation) per batch row

    def forward_block(self, cache, emb, q_pos, masks):  # type: ignore[no-untyped-def]
        R, bs = q_pos.shape
        h = torch.zeros(R, bs, self.spec.hidden_size)
        self.head.lm_head.zero_()
        col = 0
        for r in range(R):
            P, plain = self.rows[r]
            for i in range(1, bs):
                at = int(q_pos[r, 0]) + i
                tok = plain[at - P] if at - P < len(plain) else 0
                if at % 5 == 0:
                    tok = (tok + 1) % self.spec.vocab_size
                self.head.lm_head[tok, col] = 1.0
                h[r, i, col] = 1.0
                col += 1
        return h


def test_batched_speculative_decoding_equals_one_prompt_at_a_time():
    """`speculative_generate_batch`: each row's tokens and verify steps equal the one-prompt
    loop's — a real drafter (2 layers, a sliding one) whose rejected slots leave holes in the
    caches, and a partly right oracle with a stop id accepted mid-block and max_new inside a
    block; `greedy_generate_batch` equals `greedy_generate`; eval at batch size 3 reports what
    batch size 1 does."""
    from dflash.eval.decode import greedy_generate_batch, speculative_generate_batch

    cfg, t = _tiny_target()
    common = dict(
        hidden_size=t.hidden_size, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
        intermediate_size=t.intermediate_size, vocab_size=t.vocab_size, target_layer_ids=t.layer_ids,
        num_target_layers=t.num_layers, block_size=4, mask_token_id=t.vocab_size - 1,
    )  # fmt: skip
    d = DFlashDrafter(_spec(**common, num_layers=2, sliding_window=5))
    d.init_weights(torch.Generator().manual_seed(0))
    d.eval()
    head = FrozenHead(t.embed_weight.clone(), t.lm_head_weight.clone())
    prompts = [p[: 4 + 3 * i] for i, p in enumerate(draw_prompts(cfg.data, t.vocab_size, 3, 99, t.vocab_size - 1))]
    for stop in (set(), {int(greedy_generate(t, prompts[1], 8, set())[5])}):
        plains = [greedy_generate(t, p, 19, stop) for p in prompts]
        assert greedy_generate_batch(t, prompts, 19, stop) == plains
        got = speculative_generate_batch(t, d, head, prompts, 19, stop)
        for p, g, plain in zip(prompts, got, plains, strict=True):
            one = speculative_generate(t, d, head, p, 19, stop)
            assert (g.tokens, g.accepted) == (one.tokens, one.accepted) and g.tokens == plain
        oracle = _PartialOracle(_spec(**common, num_layers=1, layer_types=["full_attention"]), head, [])
        oracle.init_weights(torch.Generator().manual_seed(0))
        oracle.rows = [(p.numel(), plain) for p, plain in zip(prompts, plains, strict=True)]
        got = speculative_generate_batch(t, oracle, head, prompts, 19, stop)
        accepted = []
        for r, (p, g, plain) in enumerate(zip(prompts, got, plains, strict=True)):
            oracle.rows = [(p.numel(), plain)]
            one = speculative_generate(t, oracle, head, p, 19, stop)
            assert (g.tokens, g.accepted) == (one.tokens, one.accepted) and g.tokens == plain, r
            accepted += g.accepted
        assert max(accepted) == 3 and 0 < sum(accepted) < 3 * len(accepted), "partial acceptance exercised"
    one = evaluate(t, d, head, prompts, DecodeSettings(19))
    many = evaluate(t, d, head, prompts, DecodeSettings(19, batch_size=3))
    assert many["batch_size"] == 3 and one["batch_size"] == 1 and many["lossless"] is True
    assert many["decided_singly"] == 0
    skip = ("_s", "speedup", "batch_size")
    same = [k for k in one if not k.endswith(skip)]
    assert [many[k] for k in same] == [one[k] for k in same]


def test_batching_and_the_shared_prefix_need_full_attention_over_a_plain_cache():
    """`plain_kv_cache`: HF applies sliding windows by cache slot (mid-sequence padding and
    hidden slots would narrow them) and a generation config's own cache type refuses a
    given cache, so batched eval and regen's shared prefix are for the other targets only;
    the tiny target (Qwen3, full attention) qualifies, and eval of a sliding one falls back
    to one prompt at a time."""
    from types import SimpleNamespace

    from transformers import Gemma2Config, LlamaConfig, Qwen3Config

    from dflash.model.hf_compat import plain_kv_cache

    def model(cfg: object, cache: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(config=cfg, generation_config=SimpleNamespace(cache_implementation=cache))

    assert plain_kv_cache(model(LlamaConfig())) and plain_kv_cache(model(Qwen3Config()))
    assert not plain_kv_cache(model(Gemma2Config()))  # sliding layers
    assert not plain_kv_cache(model(Qwen3Config(use_sliding_window=True, sliding_window=8, max_window_layers=0)))
    assert not plain_kv_cache(model(LlamaConfig(), cache="hybrid"))
    _, t = _tiny_target()
    assert plain_kv_cache(t.model)
