"""The profiler: exact statistics, windows, warm-up, the Perfetto trace, and turning it off."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from dflash.runtime.profiler import Profiler, _p50_p95, _rss_mb
from tests.conftest import run_records


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_window_stats_are_exact_on_known_durations():
    """Known durations give exact count / total / mean / max / p50 / p95 / busy fraction."""
    clock = FakeClock()
    out: list[dict] = []
    p = Profiler(10.0, lambda ev, **kw: out.append(kw), clock=clock)
    for d in (0.1, 0.2, 0.3, 0.4):
        p.record("target.model_forward", d)
    clock.t += 2.0
    rec = p.window_record()
    s = rec["stages"]["target.model_forward"]
    assert rec["wall_s"] == 2.0
    assert (s["count"], s["total_s"], s["mean_ms"], s["max_ms"]) == (4, 1.0, 250.0, 400.0)
    assert s["p50_ms"] == 250.0 and s["p95_ms"] == pytest.approx(385.0)
    assert s["busy_frac"] == 0.5
    # the window rotated: the next one starts empty
    clock.t += 1.0
    assert p.window_record()["stages"] == {} and p.window_record()["window"] == 2


def test_percentiles_interpolate_linearly():
    """p50 / p95 interpolate linearly between order statistics (numpy's default), in any input order."""
    p50, p95 = _p50_p95([5.0, 1.0, 9.0, 3.0, 7.0, 2.0])
    assert p50 == 4.0
    assert p95 == pytest.approx(8.5)
    assert _p50_p95([0.25]) == (0.25, 0.25)


def test_host_rss_is_this_process_resident_memory():
    """host_rss_mb is the current resident set (MiB), and grows with memory the process touches."""
    import mmap

    before = _rss_mb()
    # fresh pages from the kernel (malloc could hand back memory already resident), each written
    block = mmap.mmap(-1, 64 * 2**20)
    for i in range(0, len(block), mmap.PAGESIZE):
        block[i] = 1
    assert 0 < before < _rss_mb() and _rss_mb() - before > 32
    block.close()


def test_warmup_flag_until_marked():
    """Windows that start before the pipeline is marked warm are flagged warmup."""
    clock = FakeClock()
    p = Profiler(1.0, lambda ev, **kw: None, clock=clock)
    clock.t += 1
    assert p.window_record()["warmup"] is True
    clock.t += 1
    p.mark_warm()
    assert p.window_record()["warmup"] is True  # this window contained the warm-up
    clock.t += 1
    assert p.window_record()["warmup"] is False


class WatchedClock(FakeClock):
    """A fake clock that counts its readings and wakes a waiter at each (the profiler's loop
    reads it once per wake-up, so readings count the loop's turns)."""

    def __init__(self) -> None:
        super().__init__()
        self.readings = 0
        self.read = asyncio.Event()

    def __call__(self) -> float:
        self.readings += 1
        self.read.set()
        return self.t

    async def readings_reach(self, n: int) -> None:
        while self.readings < n:
            self.read.clear()
            await self.read.wait()


def test_windows_rotate_at_the_interval():
    """run() emits a profile record each time its clock passes the next interval, windows
    numbered from 0, and none while the clock stands still however often the loop wakes."""
    clock = WatchedClock()
    out: list[dict] = []
    emitted = asyncio.Event()

    def emit(ev: str, **kw: object) -> None:
        out.append(kw)
        emitted.set()

    p = Profiler(0.01, emit, clock=clock)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(p.run(stop))
        await clock.readings_reach(clock.readings + 5)  # five turns of its loop, the clock unmoved
        assert out == []
        for n in (1, 2, 3):
            clock.t += 0.01
            while len(out) < n:
                emitted.clear()
                await emitted.wait()
        await clock.readings_reach(clock.readings + 5)
        assert len(out) == 3  # no record without the clock moving on
        stop.set()
        await task

    asyncio.run(main())
    assert [r["window"] for r in out] == [0, 1, 2]
    assert [r["wall_s"] for r in out] == pytest.approx([0.01] * 3)


def test_trace_is_valid_chrome_json_with_tracks(tiny_config, tmp_path):
    """--trace writes Chrome-trace JSON: a track per worker and stage, holding that stage's
    spans one after another (one per batch: 4 batches, 4 steps), and queue counters."""
    path = tmp_path / "trace.json"
    cfg = tiny_config(**{"profile.trace": f'"{path}"', "eval.at_end": "false", "train.max_steps": 4,
                         "data.source": '"random"'})  # fmt: skip
    run_records(cfg)
    doc = json.loads(path.read_text())
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in sorted((e for e in doc["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"]):
        track = tracks[e["pid"], e["tid"]]
        assert track.split(" ")[-1] == e["name"], (track, e)  # the track of its worker and stage
        spans.setdefault(track, []).append((e["ts"], e["ts"] + e["dur"]))
    for track in ("target0 target.model_forward", "drafter0 drafter.forward", "optimizer drafter.optimizer_step"):
        assert len(spans[track]) == 4, (track, spans[track])
    for track, ends in spans.items():  # one after another: each starts after the last ended
        assert all(b[0] >= a[1] - 1.0 for a, b in itertools.pairwise(ends)), (track, ends)  # 1 µs: rounding
    assert any(e["ph"] == "C" and e["name"] == "queue hidden_states" for e in doc["traceEvents"])


def test_profiling_off_emits_no_profile_records(tiny_config):
    """profile.enabled = false: the run trains and emits no profile records."""
    records = run_records(
        tiny_config(**{"profile.enabled": "false", "eval.at_end": "false", "data.source": '"random"'})
    )
    assert not [r for r in records if r["event"] == "profile"]
    assert records[-1]["event"] == "run_end" and records[-1]["steps"] > 0
