"""The profiler: exact statistics, windows, warm-up, the Perfetto trace, and turning it off."""

from __future__ import annotations

import asyncio
import json

import pytest

from dflash.runtime.profiler import Profiler, _percentile
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


def test_percentile_matches_linear_interpolation():
    """p50 / p95 interpolate linearly between order statistics (numpy's default)."""
    vals = sorted([5.0, 1.0, 9.0, 3.0, 7.0, 2.0])
    assert _percentile(vals, 0.5) == 4.0
    assert _percentile(vals, 0.95) == pytest.approx(8.5)
    assert _percentile([], 0.5) == 0.0


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


def test_windows_rotate_at_the_interval():
    """run() emits a profile record each time its clock passes the next interval, windows
    numbered from 0, and none while the clock stands still however long the loop runs."""
    clock = FakeClock()
    out: list[dict] = []
    p = Profiler(0.01, lambda ev, **kw: out.append(kw), clock=clock)

    async def until(n: int) -> None:
        while len(out) < n:
            await asyncio.sleep(0.005)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(p.run(stop))
        await asyncio.sleep(0.05)  # a few real ticks, the clock unmoved
        assert out == []
        for n in (1, 2, 3):
            clock.t += 0.01
            await asyncio.wait_for(until(n), timeout=30)
        await asyncio.sleep(0.05)
        assert len(out) == 3  # no record without the clock moving on
        stop.set()
        await asyncio.wait_for(task, timeout=60)

    asyncio.run(main())
    assert [r["window"] for r in out] == [0, 1, 2]
    assert [r["wall_s"] for r in out] == pytest.approx([0.01] * 3)


def test_trace_is_valid_chrome_json_with_tracks(tiny_config, tmp_path):
    """--trace writes Chrome-trace JSON: a track per worker and stage, queue counters."""
    path = tmp_path / "trace.json"
    cfg = tiny_config(**{"profile.trace": f'"{path}"', "eval.at_end": "false", "train.max_steps": 4,
                         "data.source": '"random"'})  # fmt: skip
    run_records(cfg)
    doc = json.loads(path.read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert {"target0 target.model_forward", "drafter0 drafter.forward", "optimizer drafter.optimizer_step"} <= names
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert any(e["ph"] == "C" and e["name"] == "queue hidden_states" for e in doc["traceEvents"])


def test_profiling_off_emits_no_profile_records(tiny_config):
    """profile.enabled = false: the run trains and emits no profile records."""
    records = run_records(
        tiny_config(**{"profile.enabled": "false", "eval.at_end": "false", "data.source": '"random"'})
    )
    assert not [r for r in records if r["event"] == "profile"]
    assert records[-1]["event"] == "run_end" and records[-1]["steps"] > 0
