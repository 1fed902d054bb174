"""The frozen target: any Hugging Face causal LM from a local folder, or a tiny random Qwen3.

Only the outputs of the chosen decoder layers are kept (forward hooks); in training the
forward stops right after the last chosen layer, so deeper layers and the LM head are never
computed. Eval reads the same hooks during full forwards (it needs logits and a KV cache).
"Layer i" is the raw output of decoder layer i: HF `hidden_states[i + 1]` for every layer
but the last, where HF's last entry has the final norm applied and the hooks' does not.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.config import TargetConfig, TinyTargetConfig
from dflash.errors import ConfigError
from dflash.runtime.devices import upload
from dflash.runtime.messages import Batch, Teacher

__all__ = [
    "Target",
    "TargetInfo",
    "TargetShape",
    "build_tiny",
    "cpu_bf16_is_fast",
    "document_mask",
    "load_target",
    "resolve_dtype",
]


class _StopForward(Exception):
    """Raised by the last needed layer's hook: nothing after it is computed."""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "fastest":
        fast = device.type == "cuda" or (device.type == "cpu" and cpu_bf16_is_fast())
        return torch.bfloat16 if fast else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@functools.cache
def cpu_bf16_is_fast() -> bool:
    """Whether this CPU multiplies bfloat16 matrices clearly faster than float32, timed once
    per process: CPUs with bf16 instructions (AVX512-BF16, AMX, Arm's BF16) run them faster,
    the others emulate them, slower. `DFLASH_CPU_BF16=0|1` overrides the timing."""
    forced = os.environ.get("DFLASH_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        msg = f"DFLASH_CPU_BF16: expected 0 or 1 (got {forced!r})"
        raise ConfigError(msg)

    def best(dtype: torch.dtype) -> float:
        x, w = torch.randn(256, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
        times = []
        for i in range(7):  # two warm-ups, then the fastest of five
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        return min(times)

    with torch.inference_mode():
        return best(torch.bfloat16) < 0.8 * best(torch.float32)


def build_tiny(cfg: TinyTargetConfig, device: torch.device | None = None) -> nn.Module:
    """A random Qwen3 from a config. On CUDA it is built on the device directly, so that a
    real-size shape (e.g. Qwen3-8B for benchmarks: compute does not depend on the weights)
    never passes through host memory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf_cfg = Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=4096,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    on_cuda = device is not None and device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if on_cuda else []):
        torch.manual_seed(cfg.seed)
        if on_cuda:
            with torch.device(device):
                model = Qwen3ForCausalLM(hf_cfg).to(torch.bfloat16)
        else:
            model = Qwen3ForCausalLM(hf_cfg)
        # A random model with std-0.02 weights barely depends on its input; larger
        # embeddings make its greedy continuations varied, so there is something to learn.
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, 1.0)
    return model


def _config_value(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(R, 1, T, T) bool, True = attend: causal inside each document of a packed row.

    Padding positions (-1) attend to themselves only, so that no row is fully masked.
    """
    T = doc_ids.shape[1]
    idx = torch.arange(T, device=doc_ids.device)
    causal = idx[:, None] >= idx[None, :]  # (T, T)
    same = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] >= 0)  # (R, T, T)
    return ((causal & same) | torch.eye(T, dtype=torch.bool, device=doc_ids.device))[:, None]


# The training forward's attention: transformers' SDPA under a name of our own. Mask creation
# knows no mask function for it, so transformers builds no mask and runs none of its host-side
# checks (with no mask and no cache, transformers 5 tests the positions for packed sequences
# with a Python bool of a device tensor: a host sync per forward on a GPU). No mask means
# causal SDPA (its fastest kernels); a packed batch brings its own 4-D document mask, which
# transformers passes through as it is.
TRAIN_ATTENTION = "dflash_sdpa"


def _train_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:  # fmt: skip
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    window = kwargs.get("sliding_window")
    q_len, k_len = query.shape[2], key.shape[2]
    if window is not None and k_len > window:  # a sliding-window layer: causal and within the window
        q = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
        k = torch.arange(k_len, device=query.device)[None, :]
        band = ((k <= q) & (q - k < window))[None, None]
        attention_mask = band if attention_mask is None else attention_mask & band
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@functools.cache
def _register_train_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(TRAIN_ATTENTION, _train_attention)


def training_view(model: nn.Module) -> nn.Module:
    """The same model (every parameter and buffer shared, no memory) with a config of its own
    whose attention is `TRAIN_ATTENTION`: eval's forwards, which need transformers' masks
    (padding, KV cache), keep the original, and may run in another thread meanwhile."""
    _register_train_attention()
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    try:
        view = copy.deepcopy(model, shared)
    except Exception as err:  # a model that cannot be copied (locks, offload maps): as it is
        warnings.warn(
            f"target: no training view ({type(err).__name__}: {err}); training forwards keep "
            "transformers' own mask preparation (a host sync per forward on a GPU)",
            stacklevel=2,
        )
        return model
    view.config._attn_implementation = TRAIN_ATTENTION
    return view


@dataclass(frozen=True)
class TargetShape:
    """The sizes of a target that a drafter made for it has too (`DrafterSpec` copies them):
    what tells a drafter for another target apart."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        heads = f"{self.num_heads} heads ({self.num_kv_heads} kv) x {self.head_dim}"
        return f"hidden {self.hidden_size}, vocab {self.vocab_size}, {self.num_layers} layers, {heads}"

    @classmethod
    def of(cls, target: TargetInfo) -> TargetShape:
        return cls(target.hidden_size, target.vocab_size, target.num_layers, target.num_heads, target.num_kv_heads,
                   target.head_dim)  # fmt: skip

    @classmethod
    def of_drafter(cls, spec: Any) -> TargetShape:
        """The target a `DrafterSpec` was made for."""
        return cls(spec.hidden_size, spec.vocab_size, spec.num_target_layers, spec.num_heads, spec.num_kv_heads,
                   spec.head_dim)  # fmt: skip

    @classmethod
    def from_config(cls, cfg: TargetConfig) -> TargetShape | None:  # no-sync: load time
        """Without loading any weights: a tiny target's config, an `hf` folder's config.json.
        None where that is not at hand (a GGUF file, a folder without a readable config)."""
        if cfg.kind == "tiny":
            t = cfg.tiny
            return cls(t.hidden_size, t.vocab_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim)
        if cfg.kind != "hf" or cfg.path is None:
            return None
        try:  # transformers' config object, as `Target` reads it (its class fills what the file leaves out)
            from transformers import AutoConfig

            c = AutoConfig.from_pretrained(Path(cfg.path).expanduser(), local_files_only=True)
            c = getattr(c, "text_config", None) or c  # a multimodal model: its language model's sizes
            heads = int(c.num_attention_heads)
            kv = _config_value(c, "num_key_value_heads", default=heads)
            head_dim = _config_value(c, "head_dim", default=int(c.hidden_size) // heads)
            return cls(int(c.hidden_size), int(c.vocab_size), int(c.num_hidden_layers), heads, int(kv),
                       int(head_dim))  # fmt: skip
        except Exception:  # any unreadable config: the check runs after loading instead
            return None


class TargetInfo:
    """What the run reads off the target's config: its sizes, RoPE, the chosen layer ids and
    its name. `Target` (the whole model) and `TargetHead` (its embeddings and LM head only)
    both describe themselves this way."""

    teacher_topk = 0  # > 0: training forwards also give their top-k next-token logits (labels, distill)

    def __init__(  # no-sync: load time
        self, cfg: Any, layer_ids: list[int], vocab_size: int, fallback_name: str
    ) -> None:
        self.num_layers = int(cfg.num_hidden_layers)
        bad = [i for i in layer_ids if i >= self.num_layers]
        if bad:
            msg = (
                f"target.layer_ids: {bad} out of range; the target has {self.num_layers} "
                f"layers (ids 0..{self.num_layers - 1})"
            )
            raise ConfigError(msg)
        self.layer_ids = list(layer_ids)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = vocab_size
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(_config_value(cfg, "num_key_value_heads", default=self.num_heads))
        self.head_dim = int(_config_value(cfg, "head_dim", default=self.hidden_size // self.num_heads))
        self.intermediate_size = int(cfg.intermediate_size)
        self.rms_norm_eps = float(_config_value(cfg, "rms_norm_eps", default=1e-6))
        rope_params = getattr(cfg, "rope_parameters", None) or {}
        self.rope_theta = float(_config_value(cfg, "rope_theta", default=rope_params.get("rope_theta", 10000.0)))
        self.max_position_embeddings = int(getattr(cfg, "max_position_embeddings", None) or 32768)
        # Logit transforms a plain LM head leaves out (Gemma's soft-capping, Cohere's scale):
        # distillation's top-k would not be the model's distribution.
        self.logit_transform = [a for a in ("final_logit_softcapping", "logit_scale", "logits_scaling")
                                if getattr(cfg, a, None) not in (None, 1, 1.0)]  # fmt: skip
        # The scaled-RoPE parameters (llama3, yarn, ...): transformers 5's rope_parameters, or 4's rope_scaling.
        given = rope_params or getattr(cfg, "rope_scaling", None) or {}
        scaling = {k: v for k, v in given.items() if k != "rope_theta"}
        self.rope_scaling = scaling if scaling.get("rope_type", scaling.get("type", "default")) != "default" else None
        self.name = str(_config_value(cfg, "_name_or_path", default="")) or fallback_name

    @property
    def embed_weight(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as the records name it, e.g. "float32"."""
        return str(self.embed_weight.dtype).removeprefix("torch.")


class Target(TargetInfo):
    """A frozen causal LM plus the layer ids whose outputs it hands to the drafter."""

    def __init__(self, model: nn.Module, layer_ids: list[int]) -> None:  # no-sync: load time
        model.eval()
        model.requires_grad_(False)
        self.model = model
        vocab = int(model.get_input_embeddings().weight.shape[0])
        super().__init__(model.config, layer_ids, vocab, type(model).__name__)
        # Thread-local (what is being captured, and whether to stop after the last layer):
        # eval may run forwards while a pipeline thread captures.
        self._local = threading.local()
        layers = self._decoder_layers()
        last = max(self.layer_ids)
        for i in self.layer_ids:
            layers[i].register_forward_hook(self._hook(i, last=(i == last)))
        self._train_model = training_view(model)  # after the hooks: the view's layers share them

    def _decoder_layers(self) -> nn.ModuleList:
        base = getattr(self.model, "model", self.model)
        layers = getattr(base, "layers", None)
        if layers is None:
            msg = f"target {type(self.model).__name__}: cannot find its decoder layers (.model.layers)"
            raise ConfigError(msg)
        return layers

    def _hook(self, i: int, last: bool) -> Any:
        def hook(_mod: nn.Module, _inp: Any, out: Any) -> None:
            record = getattr(self._local, "record", None)
            if record is not None:  # `recording`: every forward's output, in call order
                record[i].append(out[0] if isinstance(out, tuple) else out)
                return
            captured = getattr(self._local, "captured", None)
            if captured is None:  # plain forwards pass through
                return
            captured[i] = out[0] if isinstance(out, tuple) else out
            if last and self._local.stop:
                raise _StopForward

        return hook

    @contextlib.contextmanager
    def _capturing(self, stop: bool) -> Iterator[list[torch.Tensor]]:
        """Hooks on for forwards in this thread; the yielded list is filled with the chosen
        layers' outputs, in `layer_ids` order, when the block ends."""
        self._local.captured, self._local.stop = {}, stop
        layers: list[torch.Tensor] = []
        try:
            with contextlib.suppress(_StopForward):
                yield layers
            layers.extend(self._local.captured[i] for i in self.layer_ids)
        finally:
            self._local.captured = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Hooks on for every forward in this thread (e.g. the prefill and decode steps of
        `generate`): the yielded list is filled, when the block ends, with the chosen layers'
        outputs concatenated on the feature axis, `(R, S, k·H)`, S the positions fed over all
        the forwards in order (with a KV cache: the prompt, then one token a step)."""
        self._local.record = {i: [] for i in self.layer_ids}
        out: list[torch.Tensor] = []
        try:
            yield out
            if all(self._local.record[i] for i in self.layer_ids):  # at least one forward ran
                per_layer = [torch.cat(self._local.record[i], dim=1) for i in self.layer_ids]
                out.append(torch.cat(per_layer, dim=-1))
        finally:
            self._local.record = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def of_batch(self, batch: Batch, teacher_topk: int = 0) -> tuple[list[torch.Tensor], Teacher | None]:
        """A collated batch's features, its ids uploaded to the target's device: `capture`'s
        layers, or with `teacher_topk` (target labels, distillation) `teacher`'s."""
        ids, docs, pos = (upload(t, self.device) for t in (batch.input_ids, batch.doc_ids, batch.positions))
        if teacher_topk:
            return self.teacher(ids, docs, pos, batch.packed, teacher_topk)
        return self.capture(ids, docs, pos, packed=batch.packed), None  # k × (R, T, H)

    @torch.no_grad()
    def teacher(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor,
        position_ids: torch.Tensor,
        packed: bool,
        k: int,
        chunk: int = 1024,
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """`capture`'s layers, and the target's next-token distribution at every position as
        its top-k logits: values (R, T, k) float32 and token ids (R, T, k) int64 — what
        distillation needs, k·(4+8) bytes a position instead of the vocabulary. The whole
        model runs (the LM head in chunks of `chunk` positions)."""
        with self._capturing(stop=False) as layers:
            out = self._base_forward(input_ids, doc_ids, position_ids, packed)
        h = out.last_hidden_state  # (R, T, H), after the final norm
        head = self.model.get_output_embeddings()
        flat = h.reshape(-1, h.shape[-1])
        vals, idx = [], []
        for s in range(0, flat.shape[0], chunk):
            top = head(flat[s : s + chunk]).float().topk(k, dim=-1)
            vals.append(top.values)
            idx.append(top.indices)
        R, T = input_ids.shape
        return layers, (torch.cat(vals).view(R, T, k), torch.cat(idx).view(R, T, k))

    @torch.no_grad()
    def capture(
        self, input_ids: torch.Tensor, doc_ids: torch.Tensor, position_ids: torch.Tensor, packed: bool | None = None
    ) -> list[torch.Tensor]:
        """The chosen layers' outputs, each (R, T, H), in `layer_ids` order.

        `doc_ids` (R, T): -1 for padding, always at a row's end (`collate`). A packed row
        (several documents) gets a 4-D document-causal mask; otherwise none: under causal
        attention trailing padding cannot change a document's features, and with no mask
        transformers makes no host check (`training_view`), where a 2-D padding mask would
        cost a sync per forward on a GPU. Padding positions' features are never read.
        `packed` is the batch's; left None it is read off `doc_ids`, a host sync on a GPU.
        """
        if packed is None:
            packed = bool(((doc_ids[:, 1:] != doc_ids[:, :-1]) & (doc_ids[:, 1:] >= 0)).any())  # sync: tests, eval
        with self._capturing(stop=True) as layers:
            self._base_forward(input_ids, doc_ids, position_ids, packed)
        return layers

    def _base_forward(
        self, input_ids: torch.Tensor, doc_ids: torch.Tensor, position_ids: torch.Tensor, packed: bool
    ) -> Any:
        """The decoder stack (no LM head) over a batch: a document-causal mask for packed
        rows, none otherwise (see `capture`)."""
        attention_mask = document_mask(doc_ids) if packed else None
        base = getattr(self._train_model, "model", self._train_model)
        return base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)

    @torch.no_grad()
    def forward_with_features(self, **kwargs: Any) -> tuple[Any, torch.Tensor]:
        """A full forward of the causal LM (`kwargs` go to it: KV cache, positions...) and the
        chosen layers' outputs from the same hooks as `capture`, concatenated: (R, T, k·H)."""
        with self._capturing(stop=False) as layers:
            out = self.model(**kwargs)
        return out, torch.cat(layers, dim=-1)


def load_target(  # no-sync: load time
    cfg: TargetConfig, device: torch.device, num_draft_layers: int, cache_dir: str = ""
) -> Target:
    from dflash.model.drafter import default_target_layers
    from dflash.model.loading import _quiet_transformers, model_folder

    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.kind == "tiny":
        model = build_tiny(cfg.tiny, device)
    else:
        path = model_folder(cfg, cache_dir)
        _quiet_transformers()
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        except (OSError, ValueError) as err:
            msg = f"target.path: cannot load a causal LM from {path}: {err}".splitlines()[0]
            raise ConfigError(msg) from None
    model = model.to(device=device, dtype=dtype)
    n_layers = int(model.config.num_hidden_layers)
    layer_ids = cfg.layer_ids or default_target_layers(n_layers, num_draft_layers)
    return Target(model, layer_ids)
