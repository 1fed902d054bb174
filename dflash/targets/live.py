"""`target.engine = "vllm"`: the target stage's forward served live by a vLLM engine.

The trainer holds only the target's embeddings and LM head (`target.load = "head"`); each
batch's documents go to a vLLM engine in this process as token ids, under its
`extract_hidden_states` method with dflash's connector (`dflash/features/hidden_states.py`,
the same engine `dflash features` starts, any tensor parallelism vLLM takes), and the
chosen layers come back as the batch's features — nothing is written for the whole dataset.

The hand-off is vLLM's connector's: one file per request in a spool folder (a temporary
folder, or `target.engine_spool` — storage shared with the engine's hosts), which the stage
reads and deletes as soon as the batch's call returns. A batch enters the engine only when the
previous one's files are gone, so the spool never holds more than one batch of documents
(`spool_max`, in `run_end.target_engine`), and back-pressure is the pipeline's own: the target
stage takes the next batch only when its outbox has room. In the profile the target stage's
time is the engine's call (`target.engine_wait`) and the hand-off read (`target.engine_read`):
`dflash report` names either when it is the bottleneck. An engine that dies or a spool folder
that vanishes ends the run in one line naming the stage and the folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config
from dflash.engines.vllm import require_vllm, shut_down
from dflash.errors import ConfigError, DataError, DFlashError
from dflash.features.cache import doc_spans
from dflash.features.files import Entry
from dflash.features.vllm import (
    EngineSettings,
    generate_hidden,
    read_hidden,
    start_engine,
    target_meta,
    vllm_layer_ids,
)
from dflash.runtime.messages import Batch, Teacher

__all__ = ["EngineTarget", "check_engine_target", "lay_out", "prompts_of", "watch_engine"]


def check_engine_target(cfg: Config) -> None:
    """What `target.engine = "vllm"` cannot do, refused in one line before anything loads."""
    if cfg.target.engine == "local":
        return
    remote = cfg.target.engine == "remote"
    needs = [
        (remote and not cfg.target.engine_spool, "target.engine_spool (the folder `dflash serve-target` answers in)"),
        (remote and int(os.environ.get("WORLD_SIZE", "1")) > 1, "one process (one run a spool folder; not torchrun)"),
        (cfg.target.load != "head", "target.load = 'head' (the engine holds the decoder layers)"),
        (len(cfg.pipeline.target_devices) != 1, "one target chain (the engine parallelizes itself: "
         "target.engine_tensor_parallel)"),
        (cfg.data.source == "synthetic", "data other than synthetic (made by the target's own generate)"),
    ]  # fmt: skip
    for bad, what in needs:
        if bad:
            msg = f"target.engine = {cfg.target.engine!r} needs {what}"
            raise ConfigError(msg)
    if not remote:
        require_vllm()


def prompts_of(batch: Batch) -> tuple[list[int], list[list[int]]]:
    """The batch's documents, each once: their sample ids and token ids, in order of appearance."""
    prompts: dict[int, list[int]] = {}
    for r, s, e, d in doc_spans(batch):
        prompts.setdefault(d, batch.input_ids[r, s:e].tolist())
    return list(prompts), list(prompts.values())


def lay_out(
    head: Any, batch: Batch, by_id: dict[int, Entry], teacher_topk: int
) -> tuple[list[torch.Tensor], Teacher | None]:
    """An engine's entries (by sample id) in the batch's layout: one (R, T, k·H) tensor in the
    head's dtype, and with target labels the greedy next tokens as the top-1 teacher."""
    R, T = batch.input_ids.shape
    dtype = head.embed_weight.dtype
    out = torch.zeros((R, T, head.hidden_size * len(head.layer_ids)), dtype=dtype)
    teacher = (torch.zeros((R, T, 1)), torch.zeros((R, T, 1), dtype=torch.int64)) if teacher_topk else None
    for r, s, e, d in doc_spans(batch):
        entry = by_id[d]
        out[r, s:e] = entry.features.to(dtype)
        if teacher is not None:
            teacher[1][r, s:e, 0] = entry.next
    return [out], teacher


def watch_engine(llm: Any, dead: threading.Event, stop: threading.Event) -> None:
    """vLLM 0.32's offline client marks its engine dead when the engine's process exits but
    leaves a waiting `generate` blocked forever: this sets `dead` and hands that wait an error
    (a thread of its own, until `stop`)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    resources, outputs = getattr(client, "resources", None), getattr(client, "outputs_queue", None)
    if resources is None or outputs is None:
        return
    while not stop.wait(0.5):
        if getattr(resources, "engine_dead", False):
            dead.set()
            outputs.put_nowait(RuntimeError("its engine core process exited"))
            return


class EngineTarget:
    """A `TargetHead` whose batches' features come from a live vLLM engine (`of_batch`); every
    other attribute is the head's."""

    def __init__(self, head: Any, cfg: Config) -> None:
        folder, meta = target_meta(cfg)
        if meta.layer_ids != list(head.layer_ids):
            msg = f"target.engine: layer ids {meta.layer_ids} differ from the head's {head.layer_ids}"
            raise DFlashError(msg)
        self._head = head
        self._own_spool = not cfg.target.engine_spool
        self.spool = Path(cfg.target.engine_spool or tempfile.mkdtemp(prefix="dflash-engine-spool-"))
        self.spool.mkdir(parents=True, exist_ok=True)
        self.spool_max = 0  # most files the spool held at once
        self.requests = 0
        self._order = vllm_layer_ids(meta.layer_ids)[1]
        settings = EngineSettings(tensor_parallel=cfg.target.engine_tensor_parallel)
        self._lock = threading.Lock()  # one call at a time: vLLM's offline engine is not re-entrant
        self._llm = start_engine(folder, meta, self.spool, settings, cfg.data.max_seq_len + 8)
        self._watch, self._dead = threading.Event(), threading.Event()
        self._watcher = threading.Thread(target=self._watch_engine, name="dflash-engine-watch", daemon=True)
        self._watcher.start()

    def _watch_engine(self) -> None:
        watch_engine(self._llm, self._dead, self._watch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)

    def of_batch(self, batch: Batch, teacher_topk: int = 0) -> tuple[list[torch.Tensor], Teacher | None]:
        """The batch's features (one (R, T, k·H) tensor in the head's dtype), and with target
        labels the engine's greedy next tokens as the top-1 teacher: `engine_read(engine_call)`."""
        return self.engine_read(batch, self.engine_call(batch), teacher_topk)

    def engine_call(self, batch: Batch) -> tuple[list[int], list[list[int]], list[Any]]:
        """The batch's documents (each once) through the engine: (sample ids, their token ids,
        vLLM's outputs naming the files it wrote). The stage times it as `target.engine_wait`."""
        order, prompts = prompts_of(batch)
        with self._lock:
            if not self.spool.is_dir():
                msg = f"target.engine_wait: the spool folder {self.spool} is gone"
                raise DataError(msg)
            try:
                outs = generate_hidden(self._llm, prompts)
            except Exception as err:  # the engine's process died, or it refused the batch
                why = " ".join(str(err).split())[:300] or type(err).__name__
                if self._dead.is_set():
                    why = "its engine core process exited (checkpoints so far are kept: --resume continues)"
                msg = f"target.engine_wait: the vLLM engine failed: {why}"
                raise DataError(msg) from None
            self._count()
        return order, prompts, outs

    def engine_read(
        self, batch: Batch, pending: tuple[list[int], list[list[int]], list[Any]], teacher_topk: int = 0
    ) -> tuple[list[torch.Tensor], Teacher | None]:
        """The hand-off: the call's files read (and deleted) into the batch's layout. The stage
        times it as `target.engine_read`."""
        if teacher_topk > 1:
            msg = "target.engine = 'vllm': loss.distill needs the target's top-k logits, which the engine does not give"
            raise ConfigError(msg)
        order, prompts, outs = pending
        try:
            entries = read_hidden(outs, prompts, self._order, None)
        except FileNotFoundError as err:
            msg = f"target.engine_read: a request's hidden states are gone from the spool ({err.filename})"
            raise DataError(msg) from None
        self.requests += len(order)
        return lay_out(self._head, batch, dict(zip(order, entries, strict=True)), teacher_topk)

    def _count(self) -> None:
        """Called once the engine has written a call's files: the spool's high-water mark."""
        self.spool_max = max(self.spool_max, sum(1 for _ in self.spool.glob("*.safetensors")))  # one a request

    def stats(self) -> dict[str, Any]:
        return {"engine": "vllm", "requests": self.requests, "spool_max": self.spool_max, "spool": str(self.spool)}

    def close(self) -> None:
        """The engine's process ended now (not at interpreter exit); a temporary spool removed."""
        self._watch.set()
        self._watcher.join()  # at most its 0.5 s poll
        llm, self._llm = self._llm, None
        if llm is not None:
            shut_down(llm)
        if self._own_spool:
            shutil.rmtree(self.spool, ignore_errors=True)
