"""`target.engine = "remote"`, the trainer's side: `SpoolTarget` sends each batch's documents
as a request file in `target.engine_spool` and reads the features a `dflash serve-target`
writes back, watching its heartbeat (the folder's protocol: `spool_protocol.py`).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash.config import Config
from dflash.errors import ConfigError, DataError
from dflash.features.files import Entry
from dflash.runtime.messages import Batch, Teacher
from dflash.targets.live import lay_out, prompts_of
from dflash.targets.spool_protocol import atomic_write, opens, pack, write_text

__all__ = ["SpoolTarget"]


class SpoolTarget:
    """A `TargetHead` whose batches' features come from a `dflash serve-target` through
    `target.engine_spool`; every other attribute is the head's."""

    def __init__(self, head: Any, cfg: Config) -> None:
        self._head = head
        self.spool = Path(cfg.target.engine_spool)
        self.timeout_s = cfg.target.engine_timeout_s
        self.spool_max = 0  # most documents the folder held at once
        self.requests = 0
        self._run = uuid.uuid4().hex[:12]
        self._n = 0
        self._engine: dict[str, Any] | None = None
        self._beat = ("", time.monotonic())  # the last heartbeat seen, and when it changed
        try:
            self.spool.mkdir(parents=True, exist_ok=True)  # the server may start after the run
        except OSError as err:
            msg = f"target.engine_spool: cannot make the folder {self.spool} ({err.strerror})"
            raise ConfigError(msg) from None
        for old in (*self.spool.glob("req-*"), *self.spool.glob("out-*"), *self.spool.glob("err-*")):
            old.unlink(missing_ok=True)  # an earlier run's, never to be read

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)

    def of_batch(self, batch: Batch, teacher_topk: int = 0) -> tuple[list[torch.Tensor], Teacher | None]:
        return self.engine_read(batch, self.engine_call(batch), teacher_topk)

    def _gone(self, stage: str) -> DataError:
        return DataError(f"{stage}: the spool folder {self.spool} is gone")

    def _removed(self, grace_s: float = 1.0) -> bool:
        """Whether the spool folder is gone, or going: a removal deletes the files before the
        folder, so a request can vanish a moment before its folder does."""
        end = time.monotonic() + grace_s
        while self.spool.is_dir():
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def _alive(self, stage: str) -> None:
        """Raises once the server has not beaten for `timeout_s` (or never started)."""
        try:
            beat = (self.spool / "engine.alive").read_text()
        except FileNotFoundError:
            beat = ""
        now = time.monotonic()
        if beat != self._beat[0]:
            self._beat = (beat, now)
        elif now - self._beat[1] > self.timeout_s:
            if not self.spool.is_dir():
                raise self._gone(stage)
            e = self._engine
            who = f" ({e['engine']} on {e['host']}, pid {e['pid']})" if e else ""
            what = "stopped" if beat else "is not running"
            msg = (
                f"{stage}: the engine serving {self.spool}{who} {what}: no heartbeat for {self.timeout_s:g} s "
                "(target.engine_timeout_s); start `dflash serve-target` on it"
            )
            raise DataError(msg)

    def _check_engine(self) -> None:
        """The first call: the serving engine's features are the ones the drafter needs."""
        while self._engine is None:
            self._alive("target.engine_wait")
            try:
                self._engine = json.loads((self.spool / "engine.json").read_text())
            except FileNotFoundError:
                time.sleep(0.05)
        mine = [list(self._head.layer_ids), self._head.hidden_size * len(self._head.layer_ids)]
        theirs = [self._engine.get("layer_ids"), self._engine.get("width")]
        if mine != theirs:
            msg = (
                f"target.engine = 'remote': the engine serving {self.spool} gives layers {theirs[0]} "
                f"(width {theirs[1]}); this run's target.layer_ids are {mine[0]} (width {mine[1]})"
            )
            raise ConfigError(msg)

    def engine_call(self, batch: Batch) -> tuple[list[int], torch.Tensor, Path]:
        """The batch's documents sent as one request; returns when the engine's answer is whole.
        The stage times it as `target.engine_wait`."""
        self._check_engine()
        order, prompts = prompts_of(batch)
        name = f"{self._run}-{self._n:08d}"
        self._n += 1
        ids, offsets = pack([torch.tensor(p, dtype=torch.int32) for p in prompts])
        try:
            request = {"ids": ids, "offsets": offsets}
            atomic_write(self.spool / f"req-{name}.safetensors", lambda p: save_file(request, p))
        except (OSError, SafetensorError) as err:
            if not self.spool.is_dir():
                raise self._gone("target.engine_wait") from None
            msg = f"target.engine_wait: cannot write a request in {self.spool}: {' '.join(str(err).split())}"
            raise DataError(msg) from None
        req = self.spool / f"req-{name}.safetensors"
        out, err = self.spool / f"out-{name}.safetensors", self.spool / f"err-{name}.txt"
        pause = 0.001
        while not opens(out):  # an open, not a stat: NFS revalidates on open
            if opens(err):
                try:
                    why = err.read_text().strip()
                except OSError:  # removed since it opened: the folder with it, or not
                    if self._removed():
                        raise self._gone("target.engine_wait") from None
                    why = f"its reason ({err.name}) vanished unread"
                err.unlink(missing_ok=True)
                msg = f"target.engine_wait: the engine serving {self.spool} refused a batch: {why}"
                raise DataError(msg)
            self._alive("target.engine_wait")
            if not opens(req) and not opens(out) and not opens(err):
                if self._removed():
                    raise self._gone("target.engine_wait")
                msg = f"target.engine_wait: the request {req.name} vanished from {self.spool} unanswered"
                raise DataError(msg)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return order, ids, out

    def engine_read(
        self, batch: Batch, pending: tuple[list[int], torch.Tensor, Path], teacher_topk: int = 0
    ) -> tuple[list[torch.Tensor], Teacher | None]:
        """The answer read, deleted and laid out as the batch. Timed as `target.engine_read`."""
        if teacher_topk > 1:
            msg = "target.engine = 'remote': loss.distill needs the target's top-k logits; the engine gives none"
            raise ConfigError(msg)
        order, ids, path = pending
        try:
            t = load_file(path)
        except FileNotFoundError:
            if self._removed():  # the folder went with it: say so, not that one file is missing
                raise self._gone("target.engine_read") from None
            msg = f"target.engine_read: the engine's answer {path} is gone"
            raise DataError(msg) from None
        except (SafetensorError, OSError) as err:
            if self._removed(grace_s=0.0):
                raise self._gone("target.engine_read") from None
            msg = f"target.engine_read: the engine's answer {path} is not whole ({err})"
            raise DataError(msg) from None
        path.unlink(missing_ok=True)
        offsets = t["offsets"].tolist()
        width = self._head.hidden_size * len(self._head.layer_ids)
        if t["features"].dim() != 2 or t["features"].shape[1] != width:
            got = t["features"].shape[-1]
            msg = f"target.engine_read: {path} holds features of width {got}, this run's are {width}"
            raise DataError(msg)
        if len(offsets) != len(order) + 1 or not torch.equal(t["ids"], ids):
            msg = f"target.engine_read: {path} does not answer the request sent ({len(offsets) - 1} documents)"
            raise DataError(msg)
        by_id = {}
        for k, d in enumerate(order):
            a, b = offsets[k], offsets[k + 1]
            by_id[d] = Entry(t["ids"][a:b], t["features"][a:b], t["next"][a:b])
        self.spool_max = max(self.spool_max, len(order))
        self.requests += len(order)
        return lay_out(self._head, batch, by_id, teacher_topk)

    def stats(self) -> dict[str, Any]:
        return {"engine": "remote", "requests": self.requests, "spool_max": self.spool_max, "spool": str(self.spool)}

    def close(self) -> None:
        """Tells the server the run is over (it exits); the folder itself stays."""
        if self.spool.is_dir():
            write_text(self.spool / "stop", self._run)
