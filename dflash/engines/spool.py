"""`target.engine = "remote"`: the target stage fed by an engine on other hosts, through a spool
folder on storage both can reach (NFS, a cluster file system; any folder on one host).

The engine side is `dflash serve-target CONFIG` (`serve`), started where the target's weights
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

import itertools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash.config import Config
from dflash.engines.live import lay_out, prompts_of
from dflash.errors import ConfigError, DataError, DFlashError
from dflash.features.files import Entry, FeatureMeta
from dflash.runtime.messages import Batch, Teacher
from dflash.store.atomic import atomic_path

__all__ = ["SpoolTarget", "local_compute", "serve", "vllm_compute"]

BEAT_S = 1.0  # the server's heartbeat period


class EngineDied(DataError):
    """The serving engine's process exited: the server stops (after writing the batch's `err-`)."""


Compute = Callable[[list[list[int]]], list[Entry]]  # token ids of each document -> an entry each


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write` into a hidden file beside `path`, renamed to it when whole (no fsync: the hand-off
    is transient)."""
    with atomic_path(path, durable=False) as tmp:
        write(tmp)


def _write_text(path: Path, text: str) -> None:
    _atomic(path, lambda p: p.write_text(text))


def _opens(path: Path) -> bool:
    try:
        with path.open("rb"):
            return True
    except OSError:
        return False


def _pack(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([0, *(len(r) for r in rows)], dtype=torch.int64)
    return torch.cat(rows) if rows else torch.zeros(0), lengths.cumsum(0)


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
        ids, offsets = _pack([torch.tensor(p, dtype=torch.int32) for p in prompts])
        try:
            _atomic(self.spool / f"req-{name}.safetensors", lambda p: save_file({"ids": ids, "offsets": offsets}, p))
        except (OSError, SafetensorError) as err:
            if not self.spool.is_dir():
                raise self._gone("target.engine_wait") from None
            msg = f"target.engine_wait: cannot write a request in {self.spool}: {' '.join(str(err).split())}"
            raise DataError(msg) from None
        req = self.spool / f"req-{name}.safetensors"
        out, err = self.spool / f"out-{name}.safetensors", self.spool / f"err-{name}.txt"
        pause = 0.001
        while not _opens(out):  # an open, not a stat: NFS revalidates on open
            if _opens(err):
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
            if not _opens(req) and not _opens(out) and not _opens(err):
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
            _write_text(self.spool / "stop", self._run)


def local_compute(cfg: Config, device: torch.device) -> tuple[Compute, FeatureMeta]:
    """The whole target in PyTorch on `device`: each document's chosen layers and greedy next
    tokens (its own forward, no packing)."""
    from dflash.model.target import load_target

    target = load_target(cfg.target, device, cfg.drafter.num_layers, cfg.data.cache_dir)
    meta = FeatureMeta.of(target)

    def compute(prompts: list[list[int]]) -> list[Entry]:
        out = []
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.int64, device=device)
            pos = torch.arange(len(p), device=device)[None]
            layers, (_, top) = target.teacher(ids, torch.zeros_like(ids), pos, False, 1)
            features = torch.cat(layers, dim=-1)[0].cpu()
            out.append(Entry(ids[0].cpu(), features, top[0, :, 0].cpu()))
        return out

    return compute, meta


def vllm_compute(cfg: Config, scratch: Path, tensor_parallel: int) -> tuple[Compute, FeatureMeta, Any]:
    """A vLLM engine on the target (extract_hidden_states, dflash's connector writing to
    `scratch`, a folder of this host): each document's chosen layers and greedy next tokens."""
    from dflash.engines import extract
    from dflash.engines.live import watch_engine

    folder, meta = extract.target_meta(cfg)
    order = extract.vllm_layer_ids(meta.layer_ids)[1]
    llm = extract.start_engine(folder, meta, scratch, extract.EngineSettings(tensor_parallel), cfg.data.max_seq_len + 8)
    dead = threading.Event()
    threading.Thread(target=watch_engine, args=(llm, dead, threading.Event()), daemon=True).start()

    def compute(prompts: list[list[int]]) -> list[Entry]:
        try:
            return extract.read_hidden(extract.generate_hidden(llm, prompts), prompts, order, None)
        except Exception:
            if dead.is_set():
                msg = "the vLLM engine serving it died (its engine core process exited)"
                raise EngineDied(msg) from None
            raise

    return compute, meta, llm


class _Heart:
    """Rewrites `engine.alive` with a growing counter every `BEAT_S` seconds until stopped."""

    def __init__(self, spool: Path) -> None:
        self._spool, self._stop = spool, threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                _write_text(self._spool / "engine.alive", f"{n}\n")
            except OSError:  # a passing error of a shared file system, or the folder gone (the loop says so)
                pass
            self._stop.wait(BEAT_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def start_serving(spool: Path) -> _Heart:
    """The folder made ready for a server: an old `stop` removed, the heartbeat started
    (before the engine loads, which can take minutes)."""
    spool.mkdir(parents=True, exist_ok=True)
    for old in ("stop", "engine.json"):  # an earlier server's: this one writes its own once its engine is up
        (spool / old).unlink(missing_ok=True)
    return _Heart(spool)


Progress = Callable[[dict[str, Any]], None]


def serve(
    spool: Path,
    compute: Compute,
    meta: FeatureMeta,
    engine: str,
    progress: Progress | None = None,
    asked: threading.Event | None = None,
) -> dict:
    """Answers the requests in `spool` until a trainer writes `stop` or `asked` is set (Ctrl-C,
    SIGTERM: after the request in hand): the `serve_end` counts."""
    width = meta.width
    info = {"engine": engine, "host": socket.gethostname(), "pid": os.getpid(), "target": meta.target,
            "dtype": meta.dtype, "layer_ids": meta.layer_ids, "width": width}  # fmt: skip
    _write_text(spool / "engine.json", json.dumps(info))
    stats = {"requests": 0, "documents": 0, "tokens": 0, "refused": 0, "compute_s": 0.0}
    t0, pause = time.perf_counter(), 0.001
    while True:
        if not spool.is_dir():
            msg = f"dflash serve-target: the spool folder {spool} is gone"
            raise DataError(msg)
        if (spool / "stop").exists() or (asked is not None and asked.is_set()):
            stats["stopped"] = "signal" if asked is not None and asked.is_set() else "run ended"
            break
        requests = sorted(spool.glob("req-*.safetensors"))
        if not requests:
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
            continue
        pause = 0.001
        for req in requests:
            _answer(req, compute, width, stats)
            if progress is not None:
                progress(stats)
    for name in ("engine.json", "engine.alive", "stop"):
        (spool / name).unlink(missing_ok=True)
    stats["compute_s"] = round(stats["compute_s"], 3)
    stats["wall_s"] = round(time.perf_counter() - t0, 3)
    return stats


def _answer(req: Path, compute: Compute, width: int, stats: dict[str, Any]) -> None:
    """One request: its answer written whole (or its refusal), then the request deleted."""
    name = req.name.removeprefix("req-").removesuffix(".safetensors")
    try:
        t = load_file(req)
        offsets = t["offsets"].tolist()
        prompts = [t["ids"][a:b].tolist() for a, b in itertools.pairwise(offsets)]
        t0 = time.perf_counter()
        entries = compute(prompts)
        stats["compute_s"] += time.perf_counter() - t0
        features, offs = _pack([e.features.reshape(len(e.ids), width) for e in entries])
        ids, _ = _pack([e.ids.to(torch.int32) for e in entries])
        nxt, _ = _pack([e.next if e.next is not None else torch.zeros(len(e.ids), dtype=torch.int64) for e in entries])
        out = {"ids": ids, "features": features.contiguous(), "next": nxt.to(torch.int64), "offsets": offs}
        _atomic(req.with_name(f"out-{name}.safetensors"), lambda p: save_file(out, p))
        stats["requests"] += 1
        stats["documents"] += len(prompts)
        stats["tokens"] += int(offsets[-1])
    except FileNotFoundError:  # the run that sent it is gone (a new run clears the folder)
        return
    except (DFlashError, SafetensorError, RuntimeError, ValueError) as err:
        _write_text(req.with_name(f"err-{name}.txt"), " ".join(str(err).split())[:500] or type(err).__name__)
        stats["refused"] += 1
        if isinstance(err, EngineDied):  # the run has its line; this server can answer nothing more
            req.unlink(missing_ok=True)
            raise
    req.unlink(missing_ok=True)
