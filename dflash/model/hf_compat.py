"""The few transformers details that changed between 4.x and 5.x, in one place.

- The KV-cache argument is `cache` in 5.x (`past_key_values` is deprecated) and
  `past_key_values` in 4.x; the output attribute follows.
- `DynamicCache.crop(n)` meant "keep n tokens" in 4.x; 5.x takes a negative number of
  tokens to remove and refuses a positive n.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

__all__ = ["cache_kwarg", "crop_cache", "output_cache", "plain_kv_cache"]


def cache_kwarg(model: nn.Module) -> str:
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def crop_cache(cache: Any, keep: int) -> None:
    """Keep the first `keep` positions of a DynamicCache, on either API."""
    remove = cache.get_seq_length() - keep
    if remove <= 0:
        return
    try:
        cache.crop(-remove)
    except (ValueError, AssertionError, TypeError):
        cache.crop(keep)


def plain_kv_cache(model: nn.Module) -> bool:
    """Whether every layer of `model` attends over all earlier positions through an ordinary
    key/value cache: no sliding windows (HF applies those by cache slot, so padding or hidden
    slots in mid-sequence would change what a row sees), no linear-attention or recurrent
    state, no cache type of its own in the generation config."""
    cfg = getattr(model, "config", None)
    gen = getattr(model, "generation_config", None)
    if cfg is None or getattr(gen, "cache_implementation", None) is not None:
        return False
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return getattr(cfg, "sliding_window", None) is None or getattr(cfg, "use_sliding_window", True) is False
