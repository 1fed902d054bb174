"""Stage names (one source of truth) and the profiler that times them.

Every timed span goes through `Profiler.record` (called from worker threads, so it takes
a lock). Host time is the wall time of the Python call; on CUDA the span also carries a
(start, end) event pair recorded on the stage's stream, resolved lazily when a window is
emitted — timing never forces a synchronize in the hot path. Every `interval_s` one
`profile` record summarises the window: per stage count / total / mean / max / p50 / p95,
per queue depth and waits, tokens/s, memory.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psutil

from dflash.runtime.channel import Channel
from dflash.store.atomic import atomic_path

__all__ = ["Profiler", "Stage", "Trace"]


class Stage:
    """Stage names, as the DFlash training notes that dflash follows name them. Used by stages,
    profiler and report."""

    PREFETCH = "data.prefetch"
    TARGET_FORWARD = "target.model_forward"
    TARGET_CACHE_HIT = "target.feature_cache_hit"
    TARGET_STORE_READ = "target.feature_store_read"
    TARGET_ENGINE_WAIT = "target.engine_wait"  # target.engine: the engine's call for a batch
    TARGET_ENGINE_READ = "target.engine_read"  # ... and the hand-off read of what it wrote
    TARGET_PACK = "target.pack_hidden"
    TARGET_D2H = "target.d2h_copy"
    TARGET_QUEUE_PUT = "target.queue_put_wait"
    DRAFTER_QUEUE_WAIT = "drafter.queue_wait"
    DRAFTER_PREPARE = "drafter.prepare"  # a stream: its work is timed as the three spans below
    DRAFTER_H2D = "drafter.h2d_copy"
    DRAFTER_ANCHORS = "drafter.anchors"
    DRAFTER_MASK = "dflash.create_block_mask"
    DRAFTER_FORWARD = "drafter.forward"
    DRAFTER_BACKWARD = "drafter.backward"
    DRAFTER_STEP_WAIT = "drafter.step_wait"
    GRAD_REDUCE = "drafter.grad_reduce"
    ALLREDUCE = "drafter.allreduce"  # across ranks (torch.distributed), after the in-node reduce
    GRAD_NORM_SYNC = "drafter.grad_norm_sync"
    OPTIMIZER_STEP = "drafter.optimizer_step"
    METRICS_SYNC = "metrics.sync"
    EVAL = "eval.speculative"
    CHECKPOINT = "checkpoint.snapshot"

    # Waits are idle time, not work: the report keeps them apart from busy stages.
    WAITS = frozenset({TARGET_QUEUE_PUT, DRAFTER_QUEUE_WAIT, DRAFTER_STEP_WAIT})
    # The named host syncs: on a GPU their host time is mostly the wait for the device's queued
    # work; the report counts their device time as work and the rest as waiting for the GPU.
    HOST_SYNCS = frozenset({GRAD_NORM_SYNC, METRICS_SYNC})
    # Counted work that is not matmuls (AdamW): its TFLOP/s shown, no MFU against a matmul peak.
    ELEMENTWISE = frozenset({OPTIMIZER_STEP})
    # Names of streams only: their work is timed as other stages' spans.
    STREAMS_ONLY = frozenset({DRAFTER_PREPARE})

    @classmethod
    def timed(cls) -> list[str]:
        """Every stage a `profile` record can time, in the order above."""
        names = [v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)]
        return [n for n in names if n not in cls.STREAMS_ONLY]


def _p50_p95(vals: list[float]) -> tuple[float, float]:
    """Median and 95th percentile, interpolated linearly between order statistics (numpy's
    default, `statistics.quantiles`' inclusive method)."""
    if len(vals) < 2:  # quantiles needs two points
        return vals[0], vals[0]
    cuts = statistics.quantiles(vals, n=20, method="inclusive")  # every 5 %
    return cuts[9], cuts[18]


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _stage_stats(host: list[float], device: list[float] | None, wall: float) -> dict[str, float]:
    """One stage's window: host-time statistics, and device time where CUDA events gave it."""
    total = sum(host)
    p50, p95 = _p50_p95(host)
    entry = {
        "count": len(host),
        "total_s": round(total, 6),
        "mean_ms": round(1000 * total / len(host), 3),
        "max_ms": round(1000 * max(host), 3),
        "p50_ms": round(1000 * p50, 3),
        "p95_ms": round(1000 * p95, 3),
        "busy_frac": round(total / wall, 4) if wall > 0 else 0.0,
    }
    if device:
        entry["device_mean_ms"] = round(1000 * sum(device) / len(device), 3)
        entry["device_max_ms"] = round(1000 * max(device), 3)
    return entry


def _queue_stats(ch: Channel[Any]) -> dict[str, float]:
    s = ch.snapshot()
    return {
        "depth": s.depth,
        "mean_depth": round(s.mean_depth, 3),
        "max_depth": s.max_depth,
        "capacity": s.capacity,
        "min_ready": ch.min_ready,
        "put_wait_s": round(s.put_wait_s, 6),
        "get_wait_s": round(s.get_wait_s, 6),
    }


def roofline(
    stages: dict[str, dict[str, Any]], done: dict[tuple[str, str], float], peaks: dict[str, Any], tokens: float
) -> dict[str, Any]:
    """A window's FLOPs against the devices' peaks. Each stage that did counted work gets
    `tflops` (its FLOPs over its busy seconds: device time where CUDA events gave it) and
    `mfu` (that over its device's peak) in `stages`; the record's `roofline` names the stage
    furthest below its device's peak and the bound `tokens/s if every device ran at the MFU m
    of the busiest counted stage`: min over devices of m·peak / (its FLOPs per trained token)."""
    per_stage: dict[str, float] = defaultdict(float)
    per_device: dict[str, float] = defaultdict(float)
    stage_device: dict[str, str] = {}
    for (stage, dev), n in done.items():
        per_stage[stage] += n
        per_device[dev] += n
        stage_device.setdefault(stage, dev)
    mfus: dict[str, float] = {}
    busiest, busy_max = None, -1.0
    for stage, n in per_stage.items():
        entry = stages.get(stage)
        if entry is None:
            continue
        busy = entry.get("device_mean_ms", entry["mean_ms"]) * entry["count"] / 1000
        entry["gflop"] = round(n / 1e9, 3)
        entry["device"] = stage_device[stage]
        if busy <= 0:
            continue
        entry["tflops"] = round(n / busy / 1e12, 4)
        peak = peaks.get(stage_device[stage])
        if peak is not None and peak.tflops > 0 and stage not in Stage.ELEMENTWISE:
            mfus[stage] = entry["tflops"] / peak.tflops
            entry["mfu"] = round(mfus[stage], 4)
        if busy > busy_max and stage in mfus:
            busiest, busy_max = stage, busy
    shown = {d: {"tflops": p.tflops, "source": p.source, "dtype": p.dtype, "name": p.device} for d, p in peaks.items()}
    out: dict[str, Any] = {"peaks": dict(sorted(shown.items())), "gflop": round(sum(per_stage.values()) / 1e9, 3)}
    if mfus:
        out["furthest_below"] = min(mfus, key=mfus.__getitem__)
    m = mfus.get(busiest) if busiest is not None else None
    if m and tokens > 0:
        bounds = [m * peaks[d].tflops * 1e12 / (n / tokens) for d, n in per_device.items() if d in peaks and n > 0]
        if bounds:
            out["at_mfu"] = round(m, 4)
            out["bound_tokens_per_s"] = round(min(bounds), 1)
    return out


class Trace:
    """A Chrome-trace (Perfetto) timeline: one track per worker and stage, queue depths as
    counters. Bounded: after `max_events` events nothing more is kept (the file says so)."""

    def __init__(self, path: str, max_events: int) -> None:
        self.path = path
        self.max_events = max_events
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._tids: dict[tuple[str, str], int] = {}

    def _add(self, ev: dict[str, Any]) -> None:
        if len(self.events) < self.max_events:
            self.events.append(ev)
        else:
            self.dropped += 1

    def span(self, worker: str, stage: str, start: float, dur: float) -> None:
        tid = self._tids.setdefault((worker, stage), len(self._tids) + 1)
        ts = (start - self.t0) * 1e6
        self._add({"name": stage, "cat": worker, "ph": "X", "ts": round(ts, 1), "dur": round(dur * 1e6, 1),
                   "pid": 1, "tid": tid})  # fmt: skip

    def counter(self, name: str, value: float, t: float) -> None:
        self._add({"name": name, "ph": "C", "ts": round((t - self.t0) * 1e6, 1), "pid": 1, "args": {"depth": value}})

    def write(self) -> None:
        import json

        meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "dflash"}}]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"{w} {s}"}}
            for (w, s), tid in sorted(self._tids.items(), key=lambda kv: kv[1])
        ]
        doc = {"traceEvents": meta + self.events, "displayTimeUnit": "ms",
               "otherData": {"dropped_events": self.dropped, "max_events": self.max_events}}  # fmt: skip
        with atomic_path(self.path, durable=False) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)


class Profiler:
    def __init__(
        self,
        interval_s: float,
        emit: Callable[..., None],
        *,
        enabled: bool = True,
        trace: Trace | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.interval_s = interval_s
        self.enabled = enabled
        self.trace = trace
        self._clock = clock  # tests inject a fake clock
        self._emit = emit
        self._lock = threading.Lock()
        self._channels: list[Channel[Any]] = []
        self._window = 0
        self._ready_at: float | None = None  # first moment past warm-up
        self._start_window(self._clock())
        self._pending_events: list[tuple[str, Any, Any]] = []
        self._cuda_devices: set[int] = set()
        self.peaks: dict[str, Any] = {}  # device ("cpu", "cuda:0") -> its `roofline.peaks.Peak`
        self.count_flops = True  # profile.mfu

    def _start_window(self, now: float) -> None:
        self._win_start = now
        self._host: dict[str, list[float]] = defaultdict(list)
        self._device: dict[str, list[float]] = defaultdict(list)
        self._counters: dict[str, float] = defaultdict(float)
        self._flops: dict[tuple[str, str], float] = defaultdict(float)  # (stage, device) -> FLOPs done
        self._workers: dict[str, float] = defaultdict(float)  # busy host seconds per worker

    def add_channel(self, ch: Channel[Any]) -> None:
        self._channels.append(ch)

    def add_cuda_device(self, index: int) -> None:
        self._cuda_devices.add(index)

    def record(self, stage: str, host_s: float, events: tuple[Any, Any] | None = None, worker: str = "loop") -> None:
        """One span of `stage` on `worker`: host seconds, and on CUDA a (start, end) event pair."""
        if not self.enabled:
            return
        with self._lock:
            self._host[stage].append(host_s)
            if stage not in Stage.WAITS:
                self._workers[worker] += host_s
            if events is not None:
                self._pending_events.append((stage, *events))
            if self.trace is not None:
                self.trace.span(worker, stage, self._clock() - host_s, host_s)

    def count(self, name: str, n: float) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._counters[name] += n

    def add_flops(self, stage: str, flops: float, device: str) -> None:
        """FLOPs of work a span of `stage` did on `device` (counted from shapes on the host:
        `roofline.flops`; never a device sync)."""
        if not (self.enabled and self.count_flops):
            return
        with self._lock:
            self._flops[(stage, device)] += flops

    def mark_warm(self) -> None:
        """Called once the pipeline has completed its first steps; earlier windows are warm-up."""
        if self._ready_at is None:
            self._ready_at = self._clock()

    def _resolve_events(self) -> None:
        # Only events that have completed are read; the rest wait for the next window.
        still = []
        for stage, start, end in self._pending_events:
            if end.query():
                self._device[stage].append(start.elapsed_time(end) / 1000.0)
            else:
                still.append((stage, start, end))
        self._pending_events = still

    def window_record(self, final: bool = False) -> dict[str, Any]:
        now = self._clock()
        with self._lock:
            self._resolve_events()
            host, device, counters, workers = self._host, self._device, self._counters, self._workers
            done = self._flops
            wall = now - self._win_start
            warmup = self._ready_at is None or self._ready_at > self._win_start
            window = self._window
            self._window += 1
            self._start_window(now)
        rec: dict[str, Any] = {
            "window": window,
            "warmup": warmup,
            "final": final,
            "wall_s": round(wall, 4),
            "stages": {name: _stage_stats(host[name], device.get(name), wall) for name in sorted(host)},
            "queues": {ch.name: _queue_stats(ch) for ch in self._channels},
            "tokens_per_s": {
                "target": round(counters["target_tokens"] / wall, 2) if wall > 0 else 0.0,
                "drafter": round(counters["drafter_tokens"] / wall, 2) if wall > 0 else 0.0,
            },
            "samples_per_s": round(counters["samples"] / wall, 3) if wall > 0 else 0.0,
            "steps": int(counters["steps"]),  # no-sync: a Python counter
            # busy fraction of each worker thread (a device's worker, the data / optimizer ones)
            "workers": {w: round(v / wall, 4) if wall > 0 else 0.0 for w, v in sorted(workers.items())},
            "memory": {"host_rss_mb": round(_rss_mb(), 1)},
        }
        if done:
            rec["roofline"] = roofline(rec["stages"], done, self.peaks, counters["drafter_tokens"])
        if self._cuda_devices:
            import torch

            rec["memory"]["cuda"] = {
                f"cuda:{i}": {
                    "max_allocated_gb": round(torch.cuda.max_memory_allocated(i) / 2**30, 3),
                    "max_reserved_gb": round(torch.cuda.max_memory_reserved(i) / 2**30, 3),
                }
                for i in sorted(self._cuda_devices)
            }
        return rec

    def emit_window(self, final: bool = False) -> None:
        if self.enabled:
            self._emit("profile", **self.window_record(final=final))

    async def run(self, stop: asyncio.Event) -> None:
        """Emit a profile record every interval until `stop` is set (with a trace, also
        sample the queue depths every 50 ms as counters)."""
        if not self.enabled:
            await stop.wait()
            return
        tick = min(self.interval_s, 0.05) if self.trace is not None else self.interval_s
        next_window = self._clock() + self.interval_s
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=tick)
            except TimeoutError:
                pass
            if self.trace is not None:
                now = self._clock()
                with self._lock:
                    for ch in self._channels:
                        self.trace.counter(f"queue {ch.name}", len(ch), now)
            if self._clock() >= next_window and not stop.is_set():
                self.emit_window()
                next_window += self.interval_s
