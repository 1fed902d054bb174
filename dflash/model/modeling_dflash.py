"""A DFlash drafter for `transformers.AutoModel.from_pretrained(path, trust_remote_code=True)`.

dflash copies this file, unchanged, into every export as `modeling_dflash.py` and points the
export's `config.json` (`auto_map`) at it. It is self-contained (torch and transformers
only; dflash need not be installed) and computes what `dflash.load_drafter` computes:
the parameter names are the export's, so the trained weights load into it.

    model = AutoModel.from_pretrained("runs/demo/final", trust_remote_code=True)
    hidden = model(position_ids=pos, noise_embedding=emb, target_hidden=feats)  # (B, Q, H)
    logits = hidden @ target_lm_head.T

A drafter with a draft vocabulary (`draft_vocab_size` below `vocab_size`) carries its own head
over those target tokens (`model.lm_head`, the target's rows) and the maps: draft row r is
target token `r + model.d2t[r]`; `model.t2d` marks the target ids it can emit.

`position_ids` (B, S+Q) are the absolute positions of the S context features, then of the
Q block slots (one block per row, or whole blocks of `block_size`). `attention_mask` is
optional: a boolean (B, 1, Q, S+Q) tensor (True = attend) for the block attending to
[context | block]. Without one, each layer does what vLLM,
SGLang and SpecForge do (and what dflash trains): a full-attention layer lets every slot see
all context and its whole block; a sliding layer (`layer_types`, `sliding_window` W) is
causal inside the block and sees the last W positions, itself included. Keys and values
of earlier context can be kept in a `transformers` `Cache` (`past_key_values`; positions
are then taken as contiguous).

The families after DFlash add to this backbone, and their weights load into it:
DFlash2 (`dflash_config.conv_kernel_size`) a grouped dynamic convolution around every
attention and MLP sublayer (`DynamicConv`) and a candidate selector (`CandidateSelector`:
`model.candidate_selector.scores`); DSpark (`markov_rank`) a Markov head
(`model.markov_head.bias(prev)`, added to the logits) and a confidence head
(`model.confidence_head`, float32 as the export stores it). The forward returns the block
states either way; drafting with them is the caller's (dflash's `dflash.model.families`).
Every weight loads as stored, in value and dtype, with `from_pretrained`'s defaults (the
config's `torch_dtype`; the confidence head stays float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope(
    positions: torch.Tensor, head_dim: int, theta: float, scaled: tuple[torch.Tensor, float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, 1, L, head_dim) at absolute positions (B, L). `scaled`: (inverse
    frequencies, attention factor) of a scaled RoPE (`scaled_rope`); None: plain RoPE."""
    if scaled is None:
        inv, factor = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)), 1.0
    else:
        inv, factor = scaled[0].float(), scaled[1]  # on positions' device already
    freqs = positions.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, L, head_dim)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


def scaled_rope(
    head_dim: int, theta: float, rope_scaling: dict | None, max_position_embeddings: int = 32768
) -> tuple[torch.Tensor, float] | None:
    """Inverse frequencies and attention factor of a scaled RoPE (llama3, yarn, linear, ...),
    computed by transformers from a config, as the target computes its own; None when
    `rope_scaling` is empty or the default."""
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
        return None
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = Qwen3Config(
        head_dim=head_dim, rope_theta=theta, rope_scaling=dict(rope_scaling),
        max_position_embeddings=max_position_embeddings,
    )  # fmt: skip
    emb = Qwen3RotaryEmbedding(cfg)
    return emb.inv_freq.detach().clone(), float(emb.attention_scaling)  # no-sync: built on the host


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


def grouped_dynamic_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> torch.Tensor:
    """DFlash2's convolution over the slots of each block, never across a block start:
    out[t, c] = Σ_τ [t mod B ≥ τ]·(base[τ, c] + delta[t, τ, c // g])·x[t − τ, c].
    x (R, Q, H) with Q whole blocks (or one shorter block), delta (R, Q, taps, H/g), base (taps, H)."""
    Q = x.shape[1]
    taps = base.shape[0]
    slot = torch.arange(Q, device=x.device).remainder(block_size)
    out = torch.zeros_like(x)
    for tau in range(taps):
        shifted = x if tau == 0 else F.pad(x, (0, 0, tau, 0))[:, :Q]
        coef = base[tau].to(x.dtype) + delta[:, :, tau].to(x.dtype).repeat_interleave(group_size, dim=-1)
        out = out + shifted * coef * (slot >= tau).to(x.dtype)[None, :, None]
    return out


class DynamicConv(nn.Module):
    """DFlash2's pair of convolutions around one sublayer: one projection of the normed input
    gives both kernels' token-dependent parts; `prepare` convolves the sublayer's input,
    `finish` its output. Initialised to the identity (the sublayer as in DFlash)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        R, Q, _ = x.shape
        delta = self.kernel_projection(x).view(R, Q, 2, self.kernel_size, self.num_groups)
        out = grouped_dynamic_conv(x, delta[:, :, 0], self.base_kernel[0], self.block_size, self.group_size)
        return out, delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], self.block_size, self.group_size)


def around(conv: DynamicConv | None, x: torch.Tensor, sublayer) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """`sublayer(x)`, inside `conv`'s two convolutions when there is one (DFlash2)."""
    if conv is None:
        return sublayer(x)
    x, delta = conv.prepare(x)
    return conv.finish(sublayer(x), delta)


class CandidateSelector(nn.Module):
    """DFlash2's low-rank scorer of a slot's candidates given the token before it:
    score[c] = unary[c] + Σ_r predecessor[prev, r]·(W_h h)[r]·successor[c, r]."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, draft_vocab_size: int = 0) -> None:
        """`draft_vocab_size`: candidates are rows of a draft vocabulary (0: the whole one);
        predecessors are always target ids."""
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(draft_vocab_size or vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, unary: torch.Tensor, h: torch.Tensor, prev: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
        """Edge scores (..., K) of candidates `cands` (..., K: ids, or draft rows with a draft
        vocabulary) with unary scores `unary` (..., K), states `h` (..., H) and predecessor
        (target) ids `prev` (...)."""
        pred = self.predecessor_codebook[prev]
        ctx = pred * self.hidden_projection(h).to(pred.dtype)
        edge = (ctx.unsqueeze(-2) * self.successor_codebook[cands]).sum(-1)
        return unary + edge.to(unary.dtype)


class MarkovHead(nn.Module):
    """DSpark's logit bias from the previous token: W2·W1[prev] (rank r). W1 reads target ids;
    W2 writes the drafter's logits: a draft vocabulary's rows when it has one."""

    def __init__(self, vocab_size: int, rank: int, draft_vocab_size: int = 0) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size or vocab_size, bias=False)

    def bias(self, prev: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(..., V') for predecessor ids `prev` (...); `rows`: only these rows of W2."""
        w2 = self.markov_w2.weight if rows is None else self.markov_w2.weight[rows]
        return self.markov_w1(prev) @ w2.t()


class ConfidenceHead(nn.Module):
    """DSpark's estimate of each slot's acceptance: sigmoid(proj([h, W1[prev]])), in float32."""

    def __init__(self, hidden_size: int, extra: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + extra, 1)

    def forward(self, h: torch.Tensor, prev_emb: torch.Tensor | None = None) -> torch.Tensor:
        x = h.float() if prev_emb is None else torch.cat([h.float(), prev_emb.float()], dim=-1)
        with torch.autocast(x.device.type, enabled=False):  # float32 under autocast too
            return F.linear(x, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)  # logits


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from [context features | block], with the
    same projections (KV injection); q/k RMS norms; RoPE at absolute positions."""

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        H = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or H // self.num_heads
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        types = getattr(config, "layer_types", None) or []
        sliding = layer_idx < len(types) and types[layer_idx] == "sliding_attention"
        window = getattr(config, "sliding_window", None)
        self.window = int(window) if sliding and window else None  # no-sync: a config value
        # dflash's `drafter.sliding_causal_block` (default true, as the engines run them)
        dflash = getattr(config, "dflash_config", None) or {}
        self.causal = dflash.get("sliding_causal_block", True) is not False

    def default_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """No mask for a full layer; causal and windowed for a sliding one: (B, 1, Q, K)."""
        if self.window is None:
            return None
        d = q_pos[:, None, :, None] - k_pos[:, None, None, :]
        if self.causal:
            return (d >= 0) & (d < self.window)
        block = k_pos[:, None, None, :] >= q_pos[:, :1, None, None]  # keys of the block itself
        return block | (d < self.window)

    def forward(self, x, ctx, rope, mask, cache, positions):  # type: ignore[no-untyped-def]
        B, Q, _ = x.shape
        S = ctx.shape[1]
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, Q, self.num_heads, hd)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(B, S + Q, self.num_kv_heads, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, S + Q, self.num_kv_heads, hd).transpose(1, 2)
        cos, sin = rope
        q = _rotate(q, cos[:, :, -Q:], sin[:, :, -Q:])
        k = _rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if mask is None:
            q_pos = positions[:, -Q:]
            K = k.shape[2]  # with a cache, earlier keys are taken to sit right before these
            k_pos = positions if K == S + Q else positions[:, -1:] - (K - 1) + torch.arange(K, device=x.device)
            mask = self.default_mask(q_pos, k_pos)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:  # rows that see nothing (disabled blocks) give 0, not NaN
            visible = mask.any(dim=-1, keepdim=True)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~visible, enable_gqa=True)
            out = out * visible.to(out.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.num_heads * hd))


class DFlashMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)
        dflash = getattr(config, "dflash_config", None) or {}
        if dflash.get("conv_kernel_size"):  # DFlash2
            taps, group = int(dflash["conv_kernel_size"]), int(dflash["conv_group_size"])  # no-sync: config values
            block = int(getattr(config, "block_size", 16))  # no-sync: a config value
            args = (config.hidden_size, taps, group, block)
            self.attention_conv, self.mlp_conv = DynamicConv(*args), DynamicConv(*args)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, x, ctx, rope, mask, cache, positions):  # type: ignore[no-untyped-def]
        x = x + around(self.attention_conv, self.input_layernorm(x),
                       lambda h: self.self_attn(h, ctx, rope, mask, cache, positions))  # fmt: skip
        return x + around(self.mlp_conv, self.post_attention_layernorm(x), self.mlp)


class DFlashDraftModel(PreTrainedModel):
    """The drafter: fc + hidden_norm fuse the chosen target layers into one context feature;
    each decoder layer attends from the block to [context | block]; a final norm. Logits are
    the output through the target's LM head (not part of the drafter)."""

    config_class = Qwen3Config
    _no_split_modules = ("DFlashDecoderLayer",)
    # DSpark's confidence head is stored in float32 (vLLM loads it so): kept in float32 when
    # the rest loads in bfloat16 / float16 (the config's dtype), so every weight is the export's
    _keep_in_fp32_modules_strict = ("confidence_head",)
    base_model_prefix = "dflash"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash.get("target_layer_ids", []))
        self.mask_token_id = dflash.get("mask_token_id")
        self.block_size = getattr(config, "block_size", 16)
        k = len(self.target_layer_ids)
        self.fc = nn.Linear(k * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        V, H = config.vocab_size, config.hidden_size
        Vd = int(getattr(config, "draft_vocab_size", None) or V)  # no-sync: a config value
        Vd = 0 if Vd >= V else Vd
        if Vd:  # a draft vocabulary: its own head (the target's rows) and the maps
            self.lm_head = nn.Linear(H, Vd, bias=False)
            self.lm_head.weight.requires_grad_(False)  # the target's rows: frozen, as in training
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))  # target id = row + d2t[row]
            self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        if dflash.get("selector_rank"):  # DFlash2
            rank, top_k = int(dflash["selector_rank"]), int(dflash["selector_top_k"])  # no-sync: config values
            self.candidate_selector = CandidateSelector(V, H, rank, top_k, Vd)
        if getattr(config, "markov_rank", None):  # DSpark
            rank = int(config.markov_rank)  # no-sync: a config value
            self.markov_head = MarkovHead(V, rank, Vd)
            if getattr(config, "enable_confidence_head", False):
                extra = rank if getattr(config, "confidence_head_with_markov", False) else 0
                self.confidence_head = ConfidenceHead(H, extra)
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or 10000.0
        self.rope_theta = float(theta)  # no-sync: a config value
        self.rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        self._scaled: tuple[torch.Tensor, float] | bool | None = False  # computed at the first forward (not on meta)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:  # weights come from the checkpoint
        return None

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values: object | None = None,
        use_cache: bool = False,
        **kwargs: object,
    ) -> torch.Tensor:
        """Block states (B, Q, H) for block embeddings `noise_embedding` (B, Q, H) given
        `target_hidden` (B, S, k·H), the chosen target layers concatenated."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if self._scaled is False:
            max_pos = int(getattr(cfg, "max_position_embeddings", None) or 32768)  # no-sync: a config value
            self._scaled = scaled_rope(head_dim, self.rope_theta, self.rope_scaling, max_pos)
        dev = position_ids.device
        if self._scaled is not None and self._scaled[0].device != dev:  # type: ignore[index]
            self._scaled = (self._scaled[0].to(dev), self._scaled[1])  # type: ignore[index]  # no-sync: once per device
        rope = _rope(position_ids, head_dim, self.rope_theta, self._scaled)  # type: ignore[arg-type]
        cache = past_key_values if use_cache or past_key_values is not None else None
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, rope, attention_mask, cache, position_ids)
        return self.norm(x)
