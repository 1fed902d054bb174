"""vLLM's hidden-states connector, made to write on a CPU too.

vLLM's `extract_hidden_states` speculative method keeps the target's chosen layers' outputs
in a cache of their own; its example connector (`ExampleHiddenStatesConnector`) copies a
finished request's slots out of that cache and writes `hidden_states` (S, k, H) and
`token_ids` (S,) to `<shared_storage_path>/<request id>.safetensors`, holding an exclusive
lock on `<file>.lock` until the file is whole. Its copy is staged through a CUDA stream,
CUDA events and pinned host memory, none of which exists on a CPU ("no pinned memory
allocator is available on this system"). This subclass keeps vLLM's path where the cache
lives on a GPU; on a CPU it copies the slots out at once and hands the write to the same
thread pool, lock and file layout.

vLLM loads it from this module (it imports vLLM, so only `.venv-engines` can import it):
`kv_transfer_config = {"kv_connector": "HiddenStatesConnector", "kv_connector_module_path":
"dflash.features.hidden_states", "kv_role": "kv_producer", ...}`.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["HiddenStatesConnector"]


class _Done:
    """Stands in for a CUDA event on a CPU: the copy is complete when it is made."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's example hidden-states connector; where the cache is not on a CUDA device, a plain
    copy out of it (a copy, made now: the request's blocks are freed once it is reported done)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten().to(self._kv_cache.device)
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).to("cpu", copy=True)
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
