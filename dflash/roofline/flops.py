"""FLOPs of each stage's work for one batch, from the models' configs and the batch's shapes.

Counted as the code executes them — what `torch.utils.flop_counter.FlopCounterMode` counts
(tests/test_roofline.py checks it within 5 % on the tiny model and the demo recipe at SmolLM2-135M sizes): matrix
multiplies only (2 per multiply-add; norms, RoPE, softmax and elementwise work are left out),
attention as the dense kernels run it, every query against every key of its row (a padded
row's and a causal mask's skipped pairs included; packed documents share their row's square).

- Target forward: the decoder layers up to the last chosen one over the batch's (R, T)
  tokens; with target labels or distillation (`teacher`) the whole stack and the LM head.
  MoE layers: the router and the `num_experts_per_tok` experts each token goes to.
- Drafter forward: `fc` over the context, then per layer the block queries (N anchors × B
  slots a row) against the row's T context positions plus the Q block slots (KV injection:
  the same K/V projections over context and block); the last layer of a DFlash drafter skips
  the anchors' rows. DFlash2's kernel projections, DSpark's Markov and confidence heads and
  the LM head over the supervised slots (the loss's rows: the whole vocabulary, or the data's
  tokens and the drawn negatives) follow.
- Drafter backward: 2× the forward of every matmul whose weight trains and whose input needs
  a gradient; 1× where only one of them does (`fc`: its input is the target's; the frozen LM
  head: its input's gradient only); the loss's chunks recomputed in backward when there are
  several (`loss.chunk`).
- Optimizer: AdamW's ~12 elementwise FLOPs a parameter (not matmuls; not in FlopCounterMode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DecoderShape", "DrafterFlops", "drafter_step", "of_prepared", "of_target", "optimizer", "target_forward"]


@dataclass(frozen=True)
class DecoderShape:
    """A decoder stack's matmul sizes (a target's, or the drafter's own layers)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # a dense MLP's; an MoE expert's
    layers: int
    vocab: int
    experts: int = 0  # MoE: routed experts (0: a dense MLP) ...
    experts_per_token: int = 0  # ... and how many each token goes to
    shared_intermediate: int = 0  # ... and a shared expert's width, where there is one

    @classmethod
    def of_hf(cls, config: Any) -> DecoderShape:  # no-sync: Python numbers and shapes
        """From a transformers config (a multimodal one: its text model's)."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(c.num_attention_heads)
        kv = int(getattr(c, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(c, "head_dim", None) or int(c.hidden_size) // heads)
        experts = int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0)
        per_token = int(getattr(c, "num_experts_per_tok", None) or 0) if experts else 0
        width = (
            int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
            if experts
            else int(c.intermediate_size)
        )
        shared = int(getattr(c, "shared_expert_intermediate_size", None) or 0) if experts else 0
        return cls(int(c.hidden_size), heads, kv, head_dim, width, int(c.num_hidden_layers), int(c.vocab_size),
                   experts, per_token, shared)  # fmt: skip

    @classmethod
    def of_spec(cls, spec: Any) -> DecoderShape:
        """A drafter's layers (`DrafterSpec`)."""
        return cls(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size,
                   spec.num_layers, spec.vocab_size)  # fmt: skip

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def mlp_per_token(self) -> float:
        """Forward FLOPs of one token through one layer's MLP (gate, up, down)."""
        H = self.hidden
        if not self.experts:
            return 6.0 * H * self.intermediate
        routed = 6.0 * H * self.intermediate * self.experts_per_token
        return routed + 2.0 * H * self.experts + 6.0 * H * self.shared_intermediate

    def params(self) -> float:  # no-sync: Python numbers and shapes
        """Parameters of the stack (norms and embeddings left out; an MoE's every expert)."""
        H = self.hidden
        attn = H * (2 * self.q_width + 2 * self.kv_width)
        mlp = 3 * H * self.intermediate * max(1, self.experts) + 3 * H * self.shared_intermediate + H * self.experts
        return float(self.layers * (attn + mlp))


def target_forward(
    shape: DecoderShape, rows: int, length: int, layers_run: int, teacher: bool = False
) -> float:  # no-sync: Python numbers and shapes
    """FLOPs of the target stage on an (R, T) batch: `layers_run` decoder layers (the last
    chosen layer's index + 1; the capture stops there), or with `teacher` every layer and
    the LM head at every position."""
    n = float(rows * length)
    H = shape.hidden
    proj = 2.0 * n * H * (2 * shape.q_width + 2 * shape.kv_width)  # q, k, v, o
    attn = 4.0 * rows * shape.heads * float(length) ** 2 * shape.head_dim  # QKᵀ and PV, whole rows
    per_layer = proj + attn + n * shape.mlp_per_token()
    layers = shape.layers if teacher else layers_run
    return layers * per_layer + (2.0 * n * H * shape.vocab if teacher else 0.0)


@dataclass(frozen=True)
class DrafterFlops:
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def drafter_step(  # no-sync: Python numbers and shapes
    spec: Any,
    rows: int,
    length: int,
    anchors: int,
    supervised: int,
    head_rows: int,
    *,
    chunk: int = 0,
    dense: bool = True,
    visible: float | None = None,
    row_keys: float | None = None,
) -> DrafterFlops:
    """FLOPs of one micro-batch's drafter forward and backward. `rows` × `length`: the
    context (R, T); `anchors` (N): blocks a row; `supervised` (M): the slots with a loss; `head_rows`
    (V'): the loss's LM-head rows; `chunk`: loss.chunk (several chunks recompute in
    backward); `dense`: the dense mask path (queries against every key), else flex
    attention, whose blocks skip what is masked: `visible` keys a query sees on average
    (default: the dense count). `row_keys`: the keys of the dense path when they are not
    T + N·B (a sequence-parallel rank: its share of the row's queries, for its heads, against
    the whole row's keys, which comes to all heads against the whole row for its queries)."""
    d = DecoderShape.of_spec(spec)
    H, B, k = d.hidden, spec.block_size, len(spec.target_layer_ids)
    R, T, Q = float(rows), float(length), float(anchors * B)
    keys = float(visible) if not dense and visible is not None else T + Q if row_keys is None else float(row_keys)
    fc = 2.0 * R * T * k * H * H
    fwd = fc
    bwd = fc  # weight gradient only: the features need none
    drafts_only = spec.family == "dflash" and B > 1 and dense
    for i in range(spec.num_layers):
        asks = Q * (B - 1) / B if drafts_only and i == spec.num_layers - 1 else Q
        kv = 2.0 * R * (T + Q) * H * 2 * d.kv_width
        q_o = 2.0 * R * asks * H * 2 * d.q_width
        attn = 4.0 * R * d.heads * asks * keys * d.head_dim
        mlp = R * asks * d.mlp_per_token()
        conv = (
            2 * 2.0 * R * Q * H * (2 * spec.conv_kernel_size * (H // spec.conv_group_size))
            if spec.family == "dflash2"
            else 0.0
        )
        layer = kv + q_o + attn + mlp + conv
        fwd += layer
        bwd += 2 * layer
    M, V = float(supervised), float(head_rows)
    head = 2.0 * M * H * V
    extra = 0.0  # the family's heads: weights that train, inputs that need gradients
    if spec.family == "dflash2":
        extra += 2.0 * M * H * spec.selector_rank
    if spec.family == "dspark":
        extra += 2.0 * M * spec.markov_rank * V
        if spec.confidence_head:
            extra += 2.0 * M * (H + (spec.markov_rank if spec.confidence_with_markov else 0))
    recompute = chunk > 0 and supervised > chunk
    fwd += head + extra
    bwd += head + 2 * extra + ((head + extra) if recompute else 0.0)
    return DrafterFlops(fwd, bwd)


def optimizer(params: float) -> float:
    """AdamW's elementwise work a step (~12 FLOPs a parameter)."""
    return 12.0 * params


def of_target(target: Any, batch: Any, teacher_topk: int = 0) -> float:  # no-sync: Python numbers and shapes
    """`target_forward` for a collated batch through a `Target` (its decoder layers here)."""
    shape = getattr(target, "_decoder_shape", None)
    if shape is None:
        shape = target._decoder_shape = DecoderShape.of_hf(target.model.config)
    rows, length = batch.input_ids.shape
    return target_forward(shape, int(rows), int(length), max(target.layer_ids) + 1, teacher=teacher_topk > 0)


def of_prepared(rep: Any, batch: Any, chunk: int) -> DrafterFlops:  # no-sync: Python numbers and shapes
    """`drafter_step` for a prepared micro-batch (`train.step.PreparedBatch`) of replica `rep`,
    from tensors' shapes only (no device sync)."""
    spec = rep.model.spec
    rows, length = int(batch.context.shape[0]), int(batch.context.shape[1])
    anchors = int(batch.block_ids.shape[1]) // spec.block_size
    supervised = int(batch.targets.sel.numel())
    if rep.loss_vocab is not None and batch.negatives is not None:
        head_rows = int(rep.loss_vocab.lm_head.shape[0]) + int(batch.negatives.numel())
    else:
        head_rows = int(rep.head.lm_head.shape[0])
    dense = all(isinstance(m, torch.Tensor) for m in batch.masks.values())
    shard, row_keys = getattr(batch, "shard", None), None
    if shard is not None:  # a sequence-parallel rank: its context and blocks; the whole row's keys
        row_keys = shard.ctx_bounds[-1][1] + shard.block_bounds[-1][1] * spec.block_size
    return drafter_step(spec, rows, length, anchors, supervised, head_rows, chunk=chunk, dense=dense,
                        visible=getattr(batch, "visible", None), row_keys=row_keys)  # fmt: skip
