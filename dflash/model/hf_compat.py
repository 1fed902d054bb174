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

__all__ = ["cache_kwarg", "crop_cache", "output_cache"]


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
