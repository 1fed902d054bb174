"""`target.engine = "remote"`: the target stage fed by an engine on other hosts, through a spool
folder on storage both can reach (NFS, a cluster file system; any folder on one host). This
module is the folder's protocol, shared by both sides; the trainer's side is
`spool_client.SpoolTarget`, the engine's `spool_server.serve`.

The engine side is `dflash serve-target CONFIG`, started where the target's weights
and devices are — vLLM (`--engine vllm`, any tensor parallelism) or the whole target in
PyTorch (`--engine local`). The trainer loads the target's embeddings and LM head only
(`target.load = "head"`) and needs no vLLM. The folder holds, all written atomically
(a temporary name, then a rename):

- `engine.json`: who serves it (host, process, the target's layer ids, dtype, feature width),
  written once its engine is up; the trainer refuses an engine whose features differ.
- `engine.alive`: a counter the server rewrites every `BEAT_S` seconds from a thread of its
  own, whatever the engine is doing. Its content is read, not its time stamp: shared file
  systems cache attributes, and the hosts' clocks need not agree.
- `req-<run>-<n>.safetensors`: a batch's documents (packed int32 token ids and offsets),
  written by the trainer's target stage; the server runs them and deletes the request.
- `out-<run>-<n>.safetensors`: their features (the engine's dtype), greedy next tokens and
  offsets, written by the server; the trainer reads and deletes it (`target.engine_read`).
  `err-<run>-<n>.txt` instead, when the engine refused the batch: its one line.
- `stop`: written by the trainer when its run ends; the server then exits.

The bound is the in-process engine's: the target stage sends a batch only after it has read
the previous one's answer, so the folder never holds more than one batch of documents
(`spool_max` in `run_end.target_engine`); back-pressure is the pipeline's own. A server that
stops beating for `target.engine_timeout_s` (killed, its host gone), a folder that vanishes
or an answer that is not whole ends the run in one line naming the stage and the folder;
checkpoints already written stay.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dflash.errors import DataError
from dflash.features.files import Entry
from dflash.store.atomic import atomic_path

__all__ = ["BEAT_S", "Compute", "EngineDied", "atomic_write", "opens", "pack", "write_text"]

BEAT_S = 1.0  # the server's heartbeat period


class EngineDied(DataError):
    """The serving engine's process exited: the server stops (after writing the batch's `err-`)."""


Compute = Callable[[list[list[int]]], list[Entry]]  # token ids of each document -> an entry each


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """`write` into a hidden file beside `path`, renamed to it when whole (no fsync: the hand-off
    is transient)."""
    with atomic_path(path, durable=False) as tmp:
        write(tmp)


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text))


def opens(path: Path) -> bool:
    try:
        with path.open("rb"):
            return True
    except OSError:
        return False


def pack(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([0, *(len(r) for r in rows)], dtype=torch.int64)
    return torch.cat(rows) if rows else torch.zeros(0), lengths.cumsum(0)
