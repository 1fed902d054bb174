"""A safetensors file memory-mapped: its tensors as views of the file's pages, not copies.

`safetensors`' own readers copy each tensor into process memory; a store of many gigabytes
(the feature store, the tokenization cache) is read here instead through a private,
read-only-in-practice mapping (`numpy.memmap` mode "c"): the pages stay file-backed and shared
with the page cache, so reading them grows no anonymous memory, and the kernel drops them
under pressure. The header is checked against the file's size first, so a truncated or foreign
file is one `ValueError` naming it, never a crash inside a later read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

__all__ = ["map_safetensors", "tensor_starts"]

# safetensors dtype -> (numpy dtype of the mapping, torch dtype of the view)
_DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "BOOL": (np.dtype(np.bool_), torch.bool),
    "U8": (np.dtype(np.uint8), torch.uint8),
    "I32": (np.dtype("<i4"), torch.int32),
    "I64": (np.dtype("<i8"), torch.int64),
    "F16": (np.dtype("<f2"), torch.float16),
    "BF16": (np.dtype("<u2"), torch.bfloat16),  # numpy has no bfloat16: mapped as uint16, viewed
    "F32": (np.dtype("<f4"), torch.float32),
}
_MAX_HEADER = 100 * 2**20


def _header(path: Path, size: int) -> tuple[int, dict]:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            msg = f"{path}: not a safetensors file ({size} bytes)"
            raise ValueError(msg)
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            msg = f"{path}: not a safetensors file, or truncated (header of {n} bytes, file of {size})"
            raise ValueError(msg)
        try:
            return 8 + n, json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            msg = f"{path}: malformed safetensors header: {err}"
            raise ValueError(msg) from None


def tensor_starts(path: str | Path) -> dict[str, int]:
    """name -> the byte in the file where the tensor's data starts (its header alone is read)."""
    path = Path(path)
    start, header = _header(path, path.stat().st_size)
    header.pop("__metadata__", None)
    return {name: start + int(info["data_offsets"][0]) for name, info in header.items()}


def map_safetensors(path: str | Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, name -> tensor) of `path`, every tensor a view of the mapped file. Raises
    ValueError naming the file when it is not a safetensors file, is truncated, or holds a
    tensor whose bytes do not fit its shape."""
    path = Path(path)
    size = path.stat().st_size
    start, header = _header(path, size)
    meta = header.pop("__metadata__", None) or {}
    data = size - start
    out: dict[str, torch.Tensor] = {}
    mapping = np.memmap(path, dtype=np.uint8, mode="c", offset=start, shape=(data,)) if data else None
    for name, info in header.items():
        try:
            kind, shape, (a, b) = info["dtype"], [int(x) for x in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            msg = f"{path}: malformed safetensors entry {name!r}"
            raise ValueError(msg) from None
        if kind not in _DTYPES:
            msg = f"{path}: tensor {name!r} has dtype {kind}, which dflash does not map"
            raise ValueError(msg)
        np_dtype, torch_dtype = _DTYPES[kind]
        count = int(np.prod(shape)) if shape else 1
        if b > data or b - a != count * np_dtype.itemsize or a > b:
            msg = f"{path}: truncated or malformed: tensor {name!r} ({kind} {shape}) at bytes {a}..{b} of {data}"
            raise ValueError(msg)
        if count == 0 or mapping is None:
            out[name] = torch.empty(shape, dtype=torch_dtype)
            continue
        arr = mapping[a:b].view(np_dtype).reshape(shape)
        t = torch.from_numpy(arr)
        out[name] = t.view(torch_dtype) if torch_dtype == torch.bfloat16 else t
    return meta, out
