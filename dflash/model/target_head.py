"""The target without its decoder layers (`target.load = "head"`): its config, input
embeddings and LM head, read from the folder's safetensors — all a run needs when every
sample's features come from feature files (`dflash features`: a vLLM serving the target with
any parallelism wrote them; `regen.save_features`). A target too big for the trainer's
machine trains drafters this way: the trainer holds two vocabulary-sized matrices.

Which tensors to read comes from the model's own class, built on the meta device (no memory,
no weights): the names of its `get_input_embeddings()` and `get_output_embeddings()`
modules, as transformers saves them. A tied LM head is the embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError, safe_open

from dflash.config import TargetConfig
from dflash.errors import ConfigError, DataError
from dflash.model.target import TargetInfo, resolve_dtype

__all__ = ["TargetHead", "load_target_head"]


class TargetHead(TargetInfo):
    """A target of which only the config, the embeddings and the LM head are loaded. It has no
    forward: a batch whose features are not all stored ends the run (`capture`)."""

    model = None  # no decoder layers: nothing to decode with, nothing to initialise a drafter from

    def __init__(  # no-sync: load time
        self, config: Any, embed: torch.Tensor, lm_head: torch.Tensor, layer_ids: list[int], name: str
    ) -> None:
        super().__init__(config, layer_ids, int(embed.shape[0]), name)
        self.name = name  # the folder, as transformers names a model loaded from it (and `dflash features`)
        self._embed, self._lm_head = embed, lm_head

    @property
    def device(self) -> torch.device:
        return self._embed.device

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._embed

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head

    def capture(self, *_args: Any, **_kwargs: Any) -> NoReturn:
        msg = (
            "target.load = 'head': a batch has a sample without stored features and the decoder "
            "layers are not loaded; run `dflash features CONFIG` again, or use target.load = 'whole'"
        )
        raise DataError(msg)

    teacher = capture


def _module_names(config: Any) -> tuple[str, str | None]:
    """The parameter names of the input embeddings and of the LM head (None when tied), as the
    model class names them, from a weightless (meta) instance of it."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # any model class transformers cannot build without weights: one line
        msg = f"target.load = 'head': transformers cannot build {type(config).__name__} ({err})".splitlines()[0]
        raise ConfigError(msg) from None
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        msg = f"target.load = 'head': {type(model).__name__} has no LM head (get_output_embeddings())"
        raise ConfigError(msg)
    tied = head.weight is embed.weight
    return f"{names[id(embed)]}.weight", None if tied else f"{names[id(head)]}.weight"


def _shards(folder: Path) -> list[Path]:
    """The folder's safetensors files: those its index names, else every one there."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            msg = f"{index}: malformed safetensors index ({err})"
            raise ConfigError(msg) from None
        return [folder / f for f in files]
    return sorted(folder.glob("*.safetensors"))


def _read(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors from the folder's safetensors files (only their headers and those
    tensors are read)."""
    shards = _shards(folder)
    if not shards:
        msg = f"target.load = 'head': {folder} has no .safetensors weights (use target.load = 'whole')"
        raise ConfigError(msg)
    out: dict[str, torch.Tensor] = {}
    for path in shards:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in set(names) & set(f.keys()):
                    out[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as err:
            msg = f"{path}: unreadable safetensors file: {err}".splitlines()[0]
            raise ConfigError(msg) from None
    return out


def load_target_head(  # no-sync: load time
    cfg: TargetConfig, device: torch.device, num_draft_layers: int, cache_dir: str = ""
) -> TargetHead:
    """The config, embeddings and LM head of an `hf` / `gguf` target on `device`, in its dtype."""
    from dflash.model.drafter import default_target_layers
    from dflash.model.loading import model_config, model_folder

    folder = model_folder(cfg, cache_dir)
    config = model_config(folder)
    if config.get_text_config() is not config:  # checkpoints rename a composite model's keys on save
        msg = (
            f"target.load = 'head': {type(config).__name__} is a composite (multimodal) model; "
            "only a plain causal LM's embeddings and LM head are read this way"
        )
        raise ConfigError(msg)
    embed_name, head_name = _module_names(config)
    want = [embed_name] if head_name is None else [embed_name, head_name]
    found = _read(folder, want)
    if head_name is not None and head_name not in found and getattr(config, "tie_word_embeddings", False):
        head_name = None  # tied in the config, saved once
    missing = [n for n in (embed_name, head_name) if n is not None and n not in found]
    if missing:
        msg = f"target.load = 'head': {folder} has no tensor {missing[0]} (use target.load = 'whole')"
        raise ConfigError(msg)
    dtype = resolve_dtype(cfg.dtype, device)
    embed = found[embed_name].to(device=device, dtype=dtype)
    head = embed if head_name is None else found[head_name].to(device=device, dtype=dtype)
    layer_ids = cfg.layer_ids or default_target_layers(int(config.num_hidden_layers), num_draft_layers)
    return TargetHead(config, embed, head, layer_ids, str(folder))
