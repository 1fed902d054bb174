"""The config schema: one typed, strict tree of sections with `Config` at its root.

Every section forbids unknown keys and converts no types silently (`_Section`); reading,
overriding and writing the tree is `_load.py`; `dflash.config` is the public face. Kept
whole: the schema is one source of truth, read top to bottom as the tree `config show`
prints. Training has four sections: `train` (how long, how many micro-batches a step),
`optimizer` (AdamW), `schedule` (the learning rate over the run) and `loss` (what each
block slot learns and how much it counts).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
LayerType = Literal["full_attention", "sliding_attention"]


class _Section(BaseModel):
    # strict: a string is never silently turned into a number; ints are accepted for floats.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


class RunConfig(_Section):
    name: str = Field("dflash", min_length=1, description="run name; the output folder")
    output_dir: str = Field("runs", min_length=1, description="parent of run folders")
    seed: int = Field(0, ge=0, description="seeds data order, anchors and init")
    trackers: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        [], description="experiment trackers fed from the records (any of tensorboard, wandb, mlflow, trackio; "
        "`pip install 'dflash[trackers]'`): train_step scalars, profile, eval, the config; offline first",
    )  # fmt: skip
    trackers_all_ranks: bool = Field(
        False, description="under torchrun every rank writes to the trackers (named <run>.rank<N>); false: rank 0",
    )  # fmt: skip

    @field_validator("trackers")
    @classmethod
    def _trackers_once(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))


class DataFile(_Section):
    """One dataset in a mix: `[[data.files]] path = "chat.jsonl"  weight = 2.0`."""

    path: str = Field(
        min_length=1,
        description="JSONL / parquet file, a `datasets` folder, or pkg:PACKAGE/FILE inside an installed package",
    )
    weight: float = Field(1.0, gt=0, description="relative share of this file in an epoch")
    max_records: int = Field(0, ge=0, description="read only the file's first this many records; 0 = all")
    format: Literal["auto", "jsonl", "parquet", "hf_datasets"] = Field(
        "auto", description="auto: by extension (.jsonl/.json, .parquet) or folder"
    )


class DataConfig(_Section):
    source: Literal["synthetic", "random", "files"] = Field(
        "synthetic",
        description=(
            "synthetic: random prompts continued by the target; random: random ids, no target "
            "generation (throughput benchmarks only: there is nothing to learn); files: chat datasets"
        ),
    )
    files: list[DataFile] = Field([], description="source = 'files': the datasets to mix")
    num_samples: int = Field(256, ge=1, le=10_000_000, description="synthetic/random: how many samples")
    prompt_len: int = Field(16, ge=2, le=65_536, description="synthetic/random: max prompt tokens (min is half)")
    gen_len: int = Field(48, ge=2, le=65_536, description="synthetic/random: tokens with loss per sample")
    max_seq_len: int = Field(2048, ge=8, le=1_048_576, description="longest sequence, in tokens")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="what to do with longer ones")
    skip_invalid: bool = Field(False, description="skip (and count) malformed records instead of failing")
    batch_size: int = Field(8, ge=1, le=65_536, description="most sequences per batch")
    token_budget: int = Field(
        0, ge=0, le=16_777_216,
        description="most tokens per batch (rows x length) a drafter replica holds (a sequence-parallel group of N: "
        "N times that); 0 = batch_size only",
    )
    num_buckets: int = Field(1, ge=1, le=64, description="length buckets (sequences of like length batch together)")
    pack: bool = Field(False, description="pack several documents into one row (document ids keep them apart)")
    shuffle: bool = Field(
        True, description="shuffle the order of samples and batches each epoch (seeded by run.seed and the epoch)"
    )
    feature_cache_mb: int = Field(
        0, ge=0, description="keep target features of seen samples in memory (MiB); later epochs skip the target"
    )
    feature_files: bool = Field(
        True, description="read target features from the feature store beside the data files (data.jsonl -> "
        "data.features/, written by regen.save_features or `dflash features`) instead of running the target; "
        "false: ignore it (e.g. to measure the target's forward)",
    )  # fmt: skip
    cache_dir: str = Field("", description="tokenization / model cache; default ~/.cache/dflash")
    chat_template_kwargs: dict[str, bool | int | float | str] = Field(
        default_factory=dict,
        description="options of the tokenizer's chat template, e.g. {enable_thinking = false}; used alike by "
        "regen, training and eval (a mismatch is a known cause of low served acceptance)",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        reserved = {
            "tokenize", "add_generation_prompt", "return_dict", "continue_final_message", "conversation",
            "messages", "tools", "documents", "chat_template", "padding", "truncation", "return_tensors",
        }  # fmt: skip
        bad = sorted(reserved & set(v))
        if bad:
            msg = f"{', '.join(bad)}: set by dflash itself, not a template option"
            raise ValueError(msg)
        return v

    @model_validator(mode="after")
    def _files(self) -> DataConfig:
        if self.source == "files" and not self.files:
            msg = "source = 'files' needs at least one [[data.files]] entry with a path"
            raise ValueError(msg)
        if self.source != "files" and self.prompt_len + self.gen_len > self.max_seq_len:
            msg = f"prompt_len + gen_len ({self.prompt_len + self.gen_len}) exceeds max_seq_len ({self.max_seq_len})"
            raise ValueError(msg)
        return self


class TinyTargetConfig(_Section):
    """A random Qwen3 built from a config: for tests and configs/tiny.toml."""

    vocab_size: int = Field(512, ge=16, le=1_000_000, description="vocabulary size")
    hidden_size: int = Field(64, ge=8, le=65_536, description="hidden size")
    num_layers: int = Field(4, ge=1, le=256, description="decoder layers")
    num_heads: int = Field(4, ge=1, le=1024, description="attention heads")
    num_kv_heads: int = Field(2, ge=1, le=1024, description="key/value heads (grouped-query attention)")
    head_dim: int = Field(16, ge=2, le=1024, description="size of one attention head (even: RoPE)")
    intermediate_size: int = Field(128, ge=1, le=1_000_000, description="MLP width")
    rope_theta: float = Field(10_000.0, gt=0, description="RoPE base")
    seed: int = Field(0, ge=0, description="seeds the random weights")

    @model_validator(mode="after")
    def _heads(self) -> TinyTargetConfig:
        if self.num_heads % self.num_kv_heads:
            msg = "num_heads must be a multiple of num_kv_heads"
            raise ValueError(msg)
        if self.head_dim % 2:
            msg = "head_dim must be even (RoPE)"
            raise ValueError(msg)
        return self


class TargetConfig(_Section):
    kind: Literal["tiny", "hf", "gguf"] = Field(
        "tiny", description="tiny: random Qwen3; hf: a local model folder; gguf: a GGUF file"
    )
    path: str | None = Field(
        None,
        description="hf: a local model folder; gguf: a .gguf file, or pkg:PACKAGE/FILE.gguf for one "
        "shipped inside an installed Python package",
    )
    stop_token: str | None = Field(
        None, description="end-of-turn token for generation and eval (e.g. '<|im_end|>'); default: the model's eos"
    )
    layer_ids: list[int] | None = Field(
        None, description="target layers whose outputs feed the drafter; default per DFlash"
    )
    dtype: Literal["auto", "fastest", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto: bfloat16 on CUDA, float32 on CPU; fastest: bfloat16 on CUDA, and on a CPU only "
        "where it has bf16 instructions (timed once per process; elsewhere bf16 is emulated, slower)",
    )
    load: Literal["whole", "head"] = Field(
        "whole",
        description="whole: the whole target loads and runs over what the feature files do not cover; head "
        "(kind 'hf'): only its config, embeddings and LM head load (a target bigger than the trainer's machine) "
        "— every sample's features must come from feature files (`dflash features`), the eval runs in vLLM "
        "(`dflash eval --engine vllm`)",
    )
    engine: Literal["local", "vllm", "remote"] = Field(
        "local",
        description="local: the target runs here (or its features come from the feature store); vllm "
        "(with load = 'head', in a Python with vLLM: make engines): each batch's features come live from a vLLM "
        "engine started by the run (extract_hidden_states), nothing stored; remote (with load = 'head' and "
        "engine_spool): from `dflash serve-target` on other hosts, through engine_spool",
    )
    engine_tensor_parallel: int = Field(1, ge=1, description="engine = 'vllm': vLLM's tensor_parallel_size")
    engine_spool: str = Field(
        "",
        description="engine = 'vllm': the folder vLLM's connector writes each request's hidden states to and "
        "the target stage reads and deletes (at most one batch); '' = a temporary folder. engine = 'remote': "
        "the folder, on storage shared with the engine's hosts, that `dflash serve-target` answers in",
    )
    engine_timeout_s: float = Field(
        120.0,
        gt=0,
        description="engine = 'remote': how long the run waits for a server that does not beat "
        "(not started, killed, its host gone) before it stops in one line",
    )
    tiny: TinyTargetConfig = Field(TinyTargetConfig(), description="kind = 'tiny': the random Qwen3's shape")

    @field_validator("layer_ids")
    @classmethod
    def _layer_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if not v:
                msg = "must list at least one layer"
                raise ValueError(msg)
            if any(i < 0 for i in v) or len(set(v)) != len(v):
                msg = "layer ids must be distinct and >= 0"
                raise ValueError(msg)
        return v

    @model_validator(mode="after")
    def _path(self) -> TargetConfig:
        if self.kind in ("hf", "gguf") and not self.path:
            msg = f"kind = '{self.kind}' needs path = a local model {'folder' if self.kind == 'hf' else 'file'}"
            raise ValueError(msg)
        if self.load == "head" and self.kind != "hf":
            msg = (
                "load = 'head' needs kind = 'hf' (a model folder with safetensors); a GGUF is converted by "
                "loading it whole: convert it once (dflash features does) and name the folder"
                if self.kind == "gguf"
                else "load = 'head' needs kind = 'hf' (a model folder with safetensors), not the tiny target"
            )
            raise ValueError(msg)
        return self


class DFlash2Config(_Section):
    """`drafter.family = "dflash2"`: a dynamic convolution around every sublayer and a
    candidate selector over the top-k tokens of each slot (defaults: speculators 0.9's)."""

    conv_kernel_size: int = Field(2, ge=1, le=64, description="taps of each dynamic convolution (at most block_size)")
    conv_group_size: int = Field(
        16, ge=1, le=65_536, description="hidden channels sharing one dynamic kernel (must divide the hidden size)"
    )
    selector_rank: int = Field(256, ge=1, le=65_536, description="rank of the candidate selector's codebooks")
    selector_top_k: int = Field(16, ge=2, le=1024, description="candidates per slot the selector reranks")
    selector_loss: float = Field(1.0, ge=0, le=100, description="weight of the selector's K-way cross-entropy")


class DSparkConfig(_Section):
    """`drafter.family = "dspark"`: a low-rank Markov logit bias from the previous token,
    drafted left to right, and a confidence head (defaults: speculators 0.9's)."""

    markov_rank: int = Field(256, ge=1, le=65_536, description="rank of the Markov head (W2·W1[prev])")
    confidence_head: bool = Field(True, description="train a head that predicts each slot's acceptance")
    confidence_with_markov: bool = Field(True, description="the confidence head also reads W1[prev]")
    confidence_loss: float = Field(1.0, ge=0, le=100, description="weight of the confidence head's BCE")
    confidence_threshold: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="eval: verify only the drafts whose product of confidences stays at or above "
        "this (at least one); 0 = all",
    )


Family = Literal["dflash", "dflash2", "dspark"]


class DrafterConfig(_Section):
    family: Family = Field(
        "dflash",
        description="dflash; dflash2 (dynamic convolutions + candidate selector); dspark (Markov head + "
        "confidence head, every slot predicts the token after it)",
    )
    dflash2: DFlash2Config = Field(DFlash2Config(), description="family = 'dflash2': its options")
    dspark: DSparkConfig = Field(DSparkConfig(), description="family = 'dspark': its options")
    num_layers: int = Field(1, ge=1, le=64, description="draft decoder layers")
    block_size: int = Field(16, ge=2, le=256, description="B: anchor + B-1 predicted tokens (DSpark: B predicted)")
    gamma: float | None = Field(None, gt=0, description="loss decay w_k = exp(-(k-1)/gamma); default 7 for B=16")
    max_anchors: int = Field(512, ge=1, le=65_536, description="blocks per document per step")
    mask_token_id: int | None = Field(
        None, ge=0, description="token id at block positions 1..B-1; default vocab_size-1 (tiny)"
    )
    layer_types: list[LayerType] | None = Field(None, description="per draft layer; default all full_attention")
    sliding_window: int = Field(
        2048, ge=1, le=1_048_576, description="window of the sliding_attention layers, in tokens"
    )
    sliding_causal_block: bool = Field(
        True,
        description="sliding layers: causal inside a block, as vLLM, SGLang and SpecForge run them (the "
        "z-lab reference's HF code runs them bidirectional); false only for a drafter served that way",
    )
    intermediate_size: int | None = Field(None, ge=1, description="default: the target's")
    init_from_target: bool = Field(
        False,
        description="start draft layers from the target layers after the deepest captured one "
        "(where shapes match), the output norm from the target's; else random",
    )
    attention: Literal["auto", "sdpa", "flex", "grouped"] = Field(
        "auto", description="auto: flex attention on CUDA; on CPU dense-mask SDPA, or grouped for a batch whose "
        "dense mask would pass 2^26 entries; grouped: SDPA over groups of blocks, each with the context slice it "
        "can see, recomputed in backward (memory linear in the row: long rows); sdpa: the dense mask always",
    )
    draft_vocab_size: int = Field(
        0, ge=0, le=1_000_000,
        description="rows of the drafter's LM head: the tokens most often supervised in the training data (counted "
        "once, written to <run>/draft_vocab.safetensors; a resumed run keeps its checkpoint's), the end-of-turn and "
        "mask tokens always among them; 0 (or the whole vocabulary's size) = the whole vocabulary",
    )  # fmt: skip
    vocab_mapping: str | None = Field(
        None, description="a draft vocabulary made elsewhere: ours (draft_vocab.safetensors) or speculators' d2t-N.npy "
        "(t2d-N.npy beside it); sets draft_vocab_size",
    )  # fmt: skip

    @model_validator(mode="after")
    def _layers(self) -> DrafterConfig:
        for other, default in (("dflash2", DFlash2Config()), ("dspark", DSparkConfig())):
            given = getattr(self, other)
            changed = [k for k in type(given).model_fields if getattr(given, k) != getattr(default, k)]
            if self.family != other and changed:
                msg = f"drafter.{other}.{changed[0]} is set, but drafter.family is '{self.family}', not '{other}'"
                raise ValueError(msg)
        if self.family == "dflash2" and self.dflash2.conv_kernel_size > self.block_size:
            msg = (
                f"dflash2.conv_kernel_size ({self.dflash2.conv_kernel_size}) is larger than block_size "
                f"({self.block_size}): the convolution never crosses a block start"
            )
            raise ValueError(msg)
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            msg = (
                f"layer_types has {len(self.layer_types)} entries but num_layers is "
                f"{self.num_layers}; give one per draft layer"
            )
            raise ValueError(msg)
        if "sliding_attention" in (self.layer_types or []) and self.sliding_window < self.block_size:
            msg = (
                f"sliding_window ({self.sliding_window}) is smaller than block_size ({self.block_size}): the "
                "engines would window inside a block, which training does not"
            )
            raise ValueError(msg)
        return self

    @property
    def resolved_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        # Published choices: B=16 → 7, B=10 → 5, B=8 → 4; otherwise about half the block.
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, (self.block_size - 1) / 2))

    @property
    def resolved_layer_types(self) -> list[str]:
        return list(self.layer_types or ["full_attention"] * self.num_layers)


class TrainConfig(_Section):
    """How long training runs and what one optimizer step takes."""

    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    max_minutes: float = Field(
        0.0, ge=0, description="stop after this many minutes of training in this process (0 = no limit), and "
        "end as at the end of the data (checkpoint, export, eval); the LR schedule follows whichever of the "
        "steps and the time is further along, so a run cut by its budget ends decayed. One process only",
    )  # fmt: skip
    epochs: int = Field(1, ge=1, le=10_000, description="passes over the data")
    grad_accum: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        "auto",
        description='micro-batches per replica per step; "auto": 1 on a fresh run, and on resume what '
        "keeps the checkpoint's global batch (processes × replicas × grad_accum) on this number of processes",
    )
    log_every: int = Field(10, ge=1, description="train_step records are synced this often")
    max_bad_steps: int = Field(5, ge=1, description="abort after this many non-finite steps in a row")

    @property
    def fresh_grad_accum(self) -> int:
        """`grad_accum` of a run that does not resume ("auto": 1)."""
        return 1 if self.grad_accum == "auto" else self.grad_accum

    @field_validator("grad_accum", mode="before")
    @classmethod
    def _grad_accum(cls, v: Any) -> Any:
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4096):
            msg = 'expected an integer 1..4096 or "auto"'
            raise ValueError(msg)
        return v


class OptimizerConfig(_Section):
    """AdamW over the drafter's weights, the same on every replica."""

    lr: float = Field(6e-4, gt=0, le=1.0, description="peak learning rate (after warmup)")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's (beta1, beta2)")
    grad_clip: float = Field(1.0, ge=0, description="max grad norm; 0 = no clipping")

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_list(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            msg = "each beta must be in [0, 1)"
            raise ValueError(msg)
        return v


class ScheduleConfig(_Section):
    """The learning rate over the run: a linear warmup, then a decay to lr * min_lr_ratio."""

    kind: Literal["cosine", "wsd"] = Field(
        "cosine", description="after warmup: cosine decay, or wsd (warmup-stable-decay: constant, then linear decay)"
    )
    warmup_ratio: float = Field(0.04, ge=0, lt=1, description="share of the steps spent warming up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the schedule decays to lr * this")
    decay_ratio: float = Field(0.2, gt=0, le=1, description="wsd: share of the steps spent decaying, at the end")

    @model_validator(mode="after")
    def _wsd(self) -> ScheduleConfig:
        if self.kind == "wsd" and self.warmup_ratio + self.decay_ratio > 1:
            msg = (
                f"schedule.warmup_ratio + schedule.decay_ratio ({self.warmup_ratio} + {self.decay_ratio}) "
                "exceed 1: no stable phase"
            )
            raise ValueError(msg)
        return self


class LossConfig(_Section):
    """What each block slot learns and how much it counts: the training loss, whole."""

    chunk: int = Field(1024, ge=1, description="rows of LM head + CE at once (bounds [rows, vocab] logits)")
    position_weights: Literal["gamma", "dpace"] = Field(
        "gamma",
        description="weights of the block slots in the loss: gamma = the fixed decay exp(-(k-1)/drafter.gamma); "
        "dpace = D-PACE's dynamic weights, each slot's share of a smooth accepted-length surrogate from the "
        "drafter's own current confidences (moves the signal to the positions that limit acceptance now)",
    )
    dpace_alpha: float = Field(0.5, gt=0, le=1, description="D-PACE's confidence smoothing s = (1-a)·p + a")
    labels: Literal["data", "target"] = Field(
        "data",
        description="what each block slot learns: data = the dataset's next token; target = the target's greedy "
        "next token after the data prefix (for slot 1 exactly what greedy verification accepts; any text becomes "
        "self-distillation data at the cost of running the whole target with its LM head)",
    )
    greedy_prefix_only: bool = Field(
        False,
        description="with labels = 'target': slot k >= 2 counts only where the data's tokens before it in the block "
        "are the target's greedy tokens, so that its label is exactly what greedy verification compares (on text "
        "that is not the target's own, later slots otherwise learn the target's reply to a prefix it would not write)",
    )
    distill: float = Field(
        0.0, ge=0, le=1,
        description="weight of distillation from the target's next-token distribution (its top-k logits at each "
        "label position) against the hard labels; 0 = hard labels only",
    )  # fmt: skip
    distill_topk: int = Field(32, ge=1, le=4096, description="target logits kept per position for distillation")
    distill_temperature: float = Field(1.0, gt=0, le=100, description="softmax temperature of teacher and drafter")
    vocab: Literal["full", "data"] = Field(
        "full",
        description="the tokens the training loss's softmax runs over: full = the whole vocabulary; data = the tokens "
        "of the training data (the LM head, most of a small drafter's step, then costs that share of the "
        "vocabulary; a label outside it counts 0). Eval and the export keep the whole LM head",
    )
    negatives: int = Field(
        4096, ge=0, le=1_000_000,
        description="vocab = data: tokens drawn afresh for each micro-batch from outside the data's tokens, "
        "their logits corrected for the sampling (sampled softmax), so that tokens the data lacks are pushed down "
        "too (0: none; such tokens then win drafts). Fewer: a cheaper LM head",
    )  # fmt: skip
    noise_reveal_start: float = Field(
        0.0, ge=0, le=1, description="noise schedule: chance a block slot shows its true token, at step 0"
    )
    noise_reveal_end: float = Field(0.0, ge=0, le=1, description="... at the last step (linear)")

    @model_validator(mode="after")
    def _greedy_prefix(self) -> LossConfig:
        if self.greedy_prefix_only and self.labels != "target":
            msg = f"loss.greedy_prefix_only needs loss.labels = 'target' (loss.labels = {self.labels!r})"
            raise ValueError(msg)
        return self

    @model_validator(mode="after")
    def _vocab(self) -> LossConfig:
        if self.vocab == "data" and self.distill > 0:
            msg = (
                "loss.vocab = 'data' with loss.distill > 0 (the top-k may lie outside the data's tokens): set one back"
            )
            raise ValueError(msg)
        return self


# Keys that left [train] for sections of their own: an old config that names one is told
# where it went (`train.lr: moved to optimizer.lr`); a checkpoint's config is mapped over.
MOVED: dict[str, str] = {
    "train.lr": "optimizer.lr",
    "train.weight_decay": "optimizer.weight_decay",
    "train.betas": "optimizer.betas",
    "train.grad_clip": "optimizer.grad_clip",
    "train.schedule": "schedule.kind",
    "train.warmup_ratio": "schedule.warmup_ratio",
    "train.min_lr_ratio": "schedule.min_lr_ratio",
    "train.decay_ratio": "schedule.decay_ratio",
    "train.loss_chunk": "loss.chunk",
    "train.position_weights": "loss.position_weights",
    "train.dpace_alpha": "loss.dpace_alpha",
    "train.labels": "loss.labels",
    "train.greedy_prefix_only": "loss.greedy_prefix_only",
    "train.distill": "loss.distill",
    "train.distill_topk": "loss.distill_topk",
    "train.distill_temperature": "loss.distill_temperature",
    "train.loss_vocab": "loss.vocab",
    "train.loss_negatives": "loss.negatives",
    "train.noise_reveal_start": "loss.noise_reveal_start",
    "train.noise_reveal_end": "loss.noise_reveal_end",
}


class PipelineConfig(_Section):
    mode: Literal["pipeline", "serial"] = Field(
        "pipeline",
        description="serial: the same stage functions called one after another in a plain loop "
        "(dflash/pipeline/serial.py; the loop of the usual trainers, for comparison)",
    )
    target_devices: list[str] = Field(["cpu"], min_length=1, description="one target chain each")
    drafter_devices: list[str] = Field(["cpu"], min_length=1, description="one replica each")
    sequence_parallel: int = Field(
        1,
        ge=1,
        le=1024,
        description="drafter replicas that train one batch of rows together (sequence parallelism: each holds 1/N "
        "of the context and of the blocks, an all-to-all by heads around each attention): drafter_devices cut "
        "into groups of N in order (under torchrun, in each process), or with one drafter device a process, N "
        "torchrun ranks in order; a resume at another N needs the same N × data.token_budget",
    )
    batch_queue_depth: int = Field(4, ge=1, le=4096, description="prefetched batches")
    hs_queue_depth: int = Field(8, ge=1, le=4096, description="hidden-state batches in flight")
    hs_min_ready: int = Field(1, ge=1, description="drafters take only when this many are ready")
    in_order: bool = Field(
        False,
        description="drafters take hidden states in prefetch's order: several target chains train "
        "exactly as one (bit for bit), but the drafters wait for the slowest chain; false: as they arrive "
        "(checkpoints record which batches are done; a resume serves each other batch once). Several "
        "processes (torchrun): always in order",
    )
    read_ahead: int = Field(
        2,
        ge=1,
        le=64,
        description="batches the feature read stage (feature cache, feature store) reads ahead of "
        "the target, per chain",
    )
    prepare_ahead: bool | None = Field(
        None,
        description="a drafter takes and prepares its next batch while the optimizer steps (one replica "
        "only); default: on for a CUDA drafter, off on CPU (there the prepare competes with the step "
        "for the cores)",
    )
    sync_debug: bool = Field(
        False,
        description="from the third step on, a host sync outside the named ones (the grad-norm "
        "check, metrics.sync, the D2H wait; evals and checkpoints) fails the run (torch's CUDA sync "
        "debug mode; a check, used by bench/gpu_check.sh; no effect on CPU)",
    )

    @property
    def sp_in_process(self) -> int:
        """Replicas of one process that train each batch together: `sequence_parallel` over several
        drafter devices, else 1."""
        return self.sequence_parallel if len(self.drafter_devices) > 1 else 1

    @property
    def sp_across_ranks(self) -> int:
        """torchrun ranks that train each batch together: `sequence_parallel` with one drafter
        device a process, else 1."""
        return self.sequence_parallel if len(self.drafter_devices) == 1 else 1

    @field_validator("target_devices", "drafter_devices")
    @classmethod
    def _devices(cls, v: list[str]) -> list[str]:
        for d in v:
            if not _DEVICE_RE.match(d):
                msg = f"{d!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'"
                raise ValueError(msg)
        return v

    @model_validator(mode="after")
    def _min_ready(self) -> PipelineConfig:
        if self.hs_min_ready > self.hs_queue_depth:
            msg = (
                f"hs_min_ready ({self.hs_min_ready}) exceeds hs_queue_depth "
                f"({self.hs_queue_depth}); drafters would wait forever"
            )
            raise ValueError(msg)
        if len(self.drafter_devices) % self.sequence_parallel and len(self.drafter_devices) > 1:
            msg = (
                f"sequence_parallel = {self.sequence_parallel} does not divide the {len(self.drafter_devices)} "
                "drafter_devices into groups (one drafter device: groups of torchrun ranks)"
            )
            raise ValueError(msg)
        if self.prepare_ahead and len(self.drafter_devices) > 1:
            msg = (
                "prepare_ahead needs a single drafter replica: with several, a batch taken early "
                "would fall behind the step's data cursor"
            )
            raise ValueError(msg)
        return self


class ProfileConfig(_Section):
    interval_s: float = Field(10.0, gt=0, le=86_400, description="seconds per profile record")
    enabled: bool = Field(True, description="time the stages (off: no profile records; for overhead checks)")
    trace: str = Field("", description="write a Chrome-trace / Perfetto timeline to this path")
    trace_max_events: int = Field(200_000, ge=1, description="bound on the timeline's size")
    mfu: bool = Field(
        True,
        description="TFLOP/s and MFU per stage in every profile record, against a matmul probe of each device "
        "(~0.3 s once per device and dtype, cached in data.cache_dir/peaks.json)",
    )


class PromptSource(_Section):
    """A prompt set of regen.prompts with its share of the conversations answered."""

    source: str = Field(min_length=1, description="a prompt set, as a plain entry of regen.prompts names it")
    weight: float = Field(1.0, gt=0, description="its share, relative to the other sets' weights")


def _source_name(entry: str | PromptSource) -> str:
    return entry if isinstance(entry, str) else entry.source


def _source_weight(entry: str | PromptSource) -> float:
    return 1.0 if isinstance(entry, str) else entry.weight


class RegenConfig(_Section):
    """`dflash regen`: the target writes the assistant turns (self-distillation)."""

    prompts: str | list[str | PromptSource] = Field(
        "chatterbot", description="'chatterbot' (the chatterbot-corpus package), or a chat file: JSONL, or any file "
        "data.files reads (a JSON array such as ShareGPT's, parquet, pkg:PACKAGE/FILE); or a list of these, each a "
        "name or {source, weight} (a name alone: weight 1): the held-out prompts come from the first, training "
        "draws the sets' conversations interleaved by weight (each set in its own shuffled order; every "
        "conversation once, none held out), so that wherever max_prompts or max_minutes stops, each set has its "
        "share",
    )  # fmt: skip
    turns: Literal["first", "all"] = Field(
        "all", description="'all': every assistant turn of a conversation, in rounds by turn depth, each turn asked "
        "with the target's own earlier replies in its context (system, user and tool messages as the source has "
        "them); 'first': the first turn only",
    )  # fmt: skip
    max_context_tokens: int = Field(
        0, ge=0, description="skip a later turn (2, 3, ...) whose prompt — the conversation so far with the chat "
        "template — is longer than this many tokens, and the conversation's turns after it (they need its reply); "
        "counted per set in the regen record's per_set too_long (0 = none). The first turn's cap is max_prompt_tokens",
    )  # fmt: skip
    output: str = Field("regen.jsonl", min_length=1, description="JSONL written (relative: in the run folder)")
    max_prompts: int = Field(0, ge=0, description="use at most this many prompts (0 = all)")
    holdout: int = Field(32, ge=0, description="prompts kept out of training, for eval")
    max_new_tokens: int = Field(64, ge=1, le=65_536, description="longest reply, in tokens")
    batch_size: int = Field(32, ge=1, le=4096, description="prompts generated at once (server: requests in flight)")
    temperature: float = Field(0.0, ge=0, le=10, description="0 = greedy")
    seed: int = Field(0, ge=0, description="order of the prompts, and sampling")
    max_minutes: float = Field(
        0.0, ge=0, description="start no batch that would end past this many minutes, judged by the last batch's "
        "time (one batch always runs; the last one is cut to the rows that fit, so it may overshoot a little; "
        "0 = no limit); the prompts answered so far are kept and a later regen answers the rest",
    )  # fmt: skip
    max_prompt_tokens: int = Field(
        0, ge=0, description="skip training prompts longer than this many tokens with the chat template (0 = none): "
        "a long prompt costs its whole length in every row of its batch before the first reply token, so under "
        "max_minutes a cap buys more replies; held-out prompts are never skipped; with max_prompts, of those "
        "prompts",
    )  # fmt: skip

    @field_validator("prompts", mode="before")
    @classmethod
    def _prompt_entries(cls, v: Any) -> Any:
        """Each {source, weight} entry checked on its own: one line naming the entry and its fault
        (the union of a name and an entry would report every way it is neither)."""
        if not isinstance(v, list):
            return v
        out = []
        for i, entry in enumerate(v):
            if isinstance(entry, dict):
                try:
                    entry = PromptSource(**entry)
                except ValidationError as err:
                    first = err.errors()[0]
                    where = ".".join(str(x) for x in first["loc"])
                    msg = f"entry {i} ({entry}): {where}: {first['msg']}"
                    raise ValueError(msg) from None
            out.append(entry)
        return out

    @field_validator("prompts")
    @classmethod
    def _prompt_sources(cls, v: str | list[str | PromptSource]) -> str | list[str | PromptSource]:
        names = [v] if isinstance(v, str) else [n if isinstance(n, str) else n.source for n in v]
        if not names or any(not n.strip() for n in names):
            msg = "name at least one prompt set, none empty"
            raise ValueError(msg)
        if len(set(names)) < len(names):
            msg = "a prompt set is named twice"
            raise ValueError(msg)
        return v

    @property
    def prompt_sources(self) -> list[str]:
        return [self.prompts] if isinstance(self.prompts, str) else [_source_name(n) for n in self.prompts]

    @property
    def prompt_weights(self) -> list[float]:
        return [1.0] if isinstance(self.prompts, str) else [_source_weight(n) for n in self.prompts]

    save_features: bool = Field(
        False, description="keep the target features computed while generating (a folder beside the output: "
        "regen.jsonl -> regen.features/, k x hidden x 2 bytes a token); training on the output then skips the "
        "target for those conversations, the first epoch too",
    )  # fmt: skip
    server: str = Field(
        "", description="URL of an OpenAI-compatible server (vLLM, SGLang, llama.cpp) serving the target, e.g. "
        "'http://localhost:8000': it writes the replies (POST /v1/chat/completions, batch_size requests in "
        "flight) instead of the target running here; same prompts, split, resume and output ('' = off)",
    )  # fmt: skip
    server_model: str = Field("", description="the model the server is asked for ('' = the first it lists)")
    server_timeout_s: float = Field(600.0, gt=0, description="seconds one server request may take")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="who writes the replies here: 'hf', the target's own generate loop in dflash; 'vllm', "
        "vLLM's offline API in this process (needs vLLM: make engines, then .venv-engines/bin/dflash regen), fed "
        "the pending prompts as token ids and batching them itself; greedy replies are the same tokens; same "
        "prompts, split, resume and output",
    )  # fmt: skip

    @model_validator(mode="after")
    def _server(self) -> RegenConfig:
        if self.server and not self.server.startswith(("http://", "https://")):
            msg = "regen.server: not an http:// or https:// URL"
            raise ValueError(msg)
        if self.server and self.save_features:
            msg = "regen.server with regen.save_features: a server sends no target features; unset one of them"
            raise ValueError(msg)
        if self.server and self.engine == "vllm":
            msg = "regen.server with regen.engine = 'vllm': the server writes the replies, or vLLM here; unset one"
            raise ValueError(msg)
        if self.engine == "vllm" and self.save_features:
            msg = (
                "regen.save_features with regen.engine = 'vllm': vLLM's replies come without target features; "
                "unset it, and compute them from the replies with `dflash features CONFIG`"
            )
            raise ValueError(msg)
        return self


class EvalConfig(_Section):
    num_prompts: int = Field(8, ge=1, le=100_000, description="held-out prompts per eval")
    prompts: str = Field(
        "", description="chat JSONL of held-out prompts; default: regen's holdout file (files) or random (synthetic)"
    )
    target_dtype: Literal["same", "float32", "bfloat16", "float16"] = Field(
        "same",
        description="the target's dtype in eval; same = target.dtype. In bf16 a batched verify forward and "
        "one-token decoding round differently, so near-ties can flip and the lossless check fails on numerics "
        "alone: float32 makes it exact (training may still run the target in bf16)",
    )
    max_new_tokens: int = Field(64, ge=1, le=65_536, description="tokens generated per prompt")
    temperature: float = Field(
        0.0, ge=0.0, le=100.0,
        description="0: greedy, checked lossless against the target; > 0: sampled, verified by speculative "
        "sampling (exact in distribution; `lossless` is then null)",
    )  # fmt: skip
    batch_size: int = Field(
        1, ge=1, le=4096,
        description="prompts decoded at once (greedy only, and only for targets whose layers are all full "
        "attention; otherwise one at a time). 1: the papers' single-sequence speedup. More: faster, the same "
        "tokens and verify steps up to the float rounding of batched matmuls (a row that differs from batched "
        "plain decoding is decided again alone: decided_singly); speedup is then batched speculative against "
        "batched plain decoding",
    )  # fmt: skip
    every_steps: int = Field(0, ge=0, description="eval every N optimizer steps; 0 = never")
    family_head: bool = Field(
        True,
        description="draft with the drafter family's own proposal (DFlash2: its selector's walk; DSpark: its "
        "Markov bias and confidence cut); false: each slot's argmax (or sample) of the backbone's logits, the "
        "family's head left out — an ablation that shows what the head adds (dflash's own decoding only)",
    )
    at_end: bool = Field(True, description="evaluate the trained drafter when training ends")


class CheckpointConfig(_Section):
    every_steps: int = Field(0, ge=0, description="checkpoint every N optimizer steps; 0 = only at the end")
    every_minutes: float = Field(
        0.0,
        ge=0,
        description="also checkpoint after a step once this many minutes passed since the last "
        "checkpoint (or the start of training), bounding the work a failure loses; 0 = never",
    )
    at_end: bool = Field(True, description="checkpoint when the run ends (also after Ctrl-C / SIGTERM)")
    keep_last: int = Field(2, ge=1, le=10_000, description="complete checkpoints kept in <run>/checkpoints")
    export_final: bool = Field(True, description="write the trained drafter to <run>/final")
    export_gguf: Literal["", "f32", "f16", "bf16", "q8_0"] = Field(
        "",
        description="also write <run>/final.gguf for llama.cpp, its weights in this type ('' = no); its "
        "vocabulary is the target's (an hf target's converted once by llama.cpp's converter: make llamacpp)",
    )


class DistributedConfig(_Section):
    """Only read when the run is launched by torchrun with more than one process."""

    timeout_s: float = Field(
        300.0, gt=0, description="a collective that waits longer (a rank died or hangs) ends the run on every rank"
    )
    check_every: int = Field(
        100, ge=0, description="compare a checksum of the drafter weights across ranks every N steps (0 = never)"
    )
    bucket_mb: float = Field(25.0, gt=0, description="gradient all-reduce bucket size (MiB)")


class Config(_Section):
    run: RunConfig = Field(RunConfig(), description="the run's name, output folder and seed")
    data: DataConfig = Field(DataConfig(), description="the training samples: where they come from, lengths, batches")
    target: TargetConfig = Field(TargetConfig(), description="the target model whose features the drafter learns from")
    drafter: DrafterConfig = Field(DrafterConfig(), description="the drafter's shape and attention")
    train: TrainConfig = Field(TrainConfig(), description="how long training runs and what one optimizer step takes")
    optimizer: OptimizerConfig = Field(OptimizerConfig(), description="AdamW over the drafter's weights")
    schedule: ScheduleConfig = Field(ScheduleConfig(), description="the learning rate over the run")
    loss: LossConfig = Field(LossConfig(), description="what each block slot learns and how much it counts")
    pipeline: PipelineConfig = Field(PipelineConfig(), description="devices, queues and how the stages run")
    profile: ProfileConfig = Field(ProfileConfig(), description="stage timing: profile records and the trace")
    regen: RegenConfig = Field(RegenConfig(), description="`dflash regen`: the target writes the assistant turns")
    eval: EvalConfig = Field(EvalConfig(), description="speculative decoding on held-out prompts")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="checkpoints and the final export")
    distributed: DistributedConfig = Field(
        DistributedConfig(), description="several processes (torchrun): timeouts, weight checks, all-reduce"
    )

    @model_validator(mode="after")
    def _family_and_loss(self) -> Config:
        loss = self.loss
        if self.drafter.family == "dspark" and (loss.noise_reveal_start or loss.noise_reveal_end):
            msg = (
                "loss.noise_reveal_start / noise_reveal_end with drafter.family 'dspark': a revealed slot would "
                "show the label of the slot before it (every DSpark slot predicts the next position)"
            )
            raise ValueError(msg)
        if self.loss.vocab == "data" and (self.drafter.draft_vocab_size or self.drafter.vocab_mapping):
            msg = (
                "loss.vocab = 'data' with a draft vocabulary (drafter.draft_vocab_size / vocab_mapping): the draft "
                "vocabulary already bounds the loss's softmax; set one back"
            )
            raise ValueError(msg)
        if self.checkpoint.export_gguf and self.target.kind == "tiny":
            msg = "checkpoint.export_gguf: the tiny target has no vocabulary for llama.cpp; use an hf or gguf target"
            raise ValueError(msg)
        if self.checkpoint.export_gguf and not self.checkpoint.export_final:
            msg = "checkpoint.export_gguf needs checkpoint.export_final = true (the GGUF is written beside <run>/final)"
            raise ValueError(msg)
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    @property
    def regen_output(self) -> Path:
        p = Path(self.regen.output).expanduser()
        return p if p.is_absolute() else self.run_dir / p

    @property
    def regen_heldout(self) -> Path:
        """Where `dflash regen` writes its held-out prompts: next to its output."""
        out = self.regen_output
        return out.with_name(out.stem + ".heldout.jsonl")

    @property
    def heldout_prompts(self) -> Path:
        """The prompts eval reads: eval.prompts when set, else regen's held-out file — this
        run's, or the one beside a data file (a run trained on another run's regen output)."""
        if self.eval.prompts:
            return Path(self.eval.prompts).expanduser()
        beside = [Path(f.path).expanduser() for f in self.data.files] if self.data.source == "files" else []
        for p in [self.regen_heldout, *(f.with_name(f.stem + ".heldout.jsonl") for f in beside)]:
            if p.is_file():
                return p
        return self.regen_heldout
