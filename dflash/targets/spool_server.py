"""`dflash serve-target CONFIG`, the engine's side of `target.engine = "remote"`: the target
computed where its weights and devices are — vLLM (`vllm_compute`, any tensor parallelism) or
the whole target in PyTorch (`local_compute`) — answering the request files a trainer writes
in the spool folder, beating its heartbeat from a thread of its own (the folder's protocol:
`spool_protocol.py`).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash.config import Config
from dflash.errors import DataError, DFlashError
from dflash.features.files import Entry, FeatureMeta
from dflash.targets.spool_protocol import BEAT_S, Compute, EngineDied, atomic_write, pack, write_text

__all__ = ["local_compute", "serve", "start_serving", "vllm_compute"]


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
    from dflash.features import vllm as extract
    from dflash.targets.live import watch_engine

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
                write_text(self._spool / "engine.alive", f"{n}\n")
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
    write_text(spool / "engine.json", json.dumps(info))
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
        features, offs = pack([e.features.reshape(len(e.ids), width) for e in entries])
        ids, _ = pack([e.ids.to(torch.int32) for e in entries])
        nxt, _ = pack([e.next if e.next is not None else torch.zeros(len(e.ids), dtype=torch.int64) for e in entries])
        out = {"ids": ids, "features": features.contiguous(), "next": nxt.to(torch.int64), "offsets": offs}
        atomic_write(req.with_name(f"out-{name}.safetensors"), lambda p: save_file(out, p))
        stats["requests"] += 1
        stats["documents"] += len(prompts)
        stats["tokens"] += int(offsets[-1])
    except FileNotFoundError:  # the run that sent it is gone (a new run clears the folder)
        return
    except (DFlashError, SafetensorError, RuntimeError, ValueError) as err:
        write_text(req.with_name(f"err-{name}.txt"), " ".join(str(err).split())[:500] or type(err).__name__)
        stats["refused"] += 1
        if isinstance(err, EngineDied):  # the run has its line; this server can answer nothing more
            req.unlink(missing_ok=True)
            raise
    req.unlink(missing_ok=True)
