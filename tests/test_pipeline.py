"""The coordinator end to end on CPU: learning, replicas, failures, embedding, stopping."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import threading
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from dflash import ConfigError, Coordinator, StageError
from dflash.runtime.profiler import Stage
from dflash.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.conftest import run_records

# The end-of-run eval, short, where a test asserts nothing of its figures: it still runs.
SHORT_EVAL = {"eval.num_prompts": 1, "eval.max_new_tokens": 8}


def _run(cfg) -> Coordinator:
    """Run to the end; the coordinator (for its replicas)."""
    coord = Coordinator(cfg, log=False)
    asyncio.run(coord.run())
    return coord


def test_loss_goes_down_and_records_are_complete(tiny_config):
    """A short tiny run lowers the loss, and emits run_start, train_step, profile, run_end."""
    cfg = tiny_config(**{"data.num_samples": 128, "train.epochs": 2, "optimizer.lr": 2e-2, **SHORT_EVAL})
    records = run_records(cfg)
    events = [r["event"] for r in records]
    assert events[0] == "run_start" and events[-1] == "run_end"
    assert "profile" in events
    steps = [r for r in records if r["event"] == "train_step"]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert len(steps) == records[-1]["steps"] == 32
    first = sum(s["loss"] for s in steps[:4]) / 4
    last = sum(s["loss"] for s in steps[-4:]) / 4
    assert last < first - 0.05, (first, last)
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "acc", "tau_sim"):
        assert key in steps[0]
    profiles = [r for r in records if r["event"] == "profile"]
    assert profiles[-1]["final"] and all("hidden_states" in p["queues"] for p in profiles)
    for stage in (Stage.TARGET_FORWARD, Stage.TARGET_PACK, Stage.DRAFTER_FORWARD, Stage.DRAFTER_BACKWARD):
        assert sum(p["stages"].get(stage, {}).get("count", 0) for p in profiles) >= 32, stage
    assert (cfg.run_dir / "config.toml").is_file()
    assert (cfg.run_dir / "final" / "model.safetensors").is_file()


def test_two_replicas_stay_bit_identical(tiny_config):
    """Two drafter replicas (and two target chains) on CPU end with identical weights."""
    cfg = tiny_config(
        **{
            "pipeline.drafter_devices": '["cpu", "cpu"]',
            "pipeline.target_devices": '["cpu", "cpu"]',
            "data.num_samples": 40,
            **SHORT_EVAL,
        }
    )
    coord = _run(cfg)
    a, b = (r.model.state_dict() for r in coord.replicas)
    assert coord.steps == 3  # 5 batches over 2 replicas: 2 full steps and one with one replica
    init = type(coord.replicas[0].model)(coord.replicas[0].model.spec).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], init[k]) for k in a if "norm" not in k)


def test_several_target_chains_train_as_one(tiny_config, monkeypatch):
    """Target chains finish batches out of order (here batch 3k's forward waits until batch
    3k+1's, in another chain, is done, and batch 0's until batch 1 has reached the drafter's
    channel); with pipeline.in_order the drafter still takes them in prefetch's order, so every
    step's batches are the ones before it: three chains give one chain's losses step for step."""
    from dflash.runtime.channel import Channel
    from dflash.stages import target_forward

    one = _chain_losses(tiny_config, 1)
    batches = len(one)  # one replica, no accumulation: a step per batch
    assert batches == 8

    forward, put, get = target_forward.forward, Channel.put, Channel.get
    ended = [threading.Event() for _ in range(batches)]
    second = threading.Event()  # batch 1 reached the hidden-state channel
    finished: list[int] = []  # Batch.seq, in the order the target forwards ended
    arrived: list[int] = []  # Batch.seq, in the order batches reached the hidden-state channel
    taken: list[int] = []  # Batch.seq, in the order the drafter took them
    lock = threading.Lock()  # the chains' worker threads append concurrently

    def reordered(target, batch, teacher_topk=0):
        # Batch 0 waits for batch 1's arrival, the others for a forward only: a chain's pack
        # and copy run on its device's thread, behind a forward that waits.
        if batch.seq == 0:
            assert second.wait(60), "batch 1 never came"  # a hang guard only
        elif batch.seq % 3 == 0 and batch.seq + 1 < batches:
            assert ended[batch.seq + 1].wait(60), f"batch {batch.seq + 1} never ended"  # a hang guard only
        out = forward(target, batch, teacher_topk)
        with lock:
            finished.append(batch.seq)
        ended[batch.seq].set()
        return out

    async def arriving(self, item):  # on the event loop, as is `recorded`
        if self.name == "hidden_states":
            arrived.append(item.batch.seq)
            if item.batch.seq == 1:
                second.set()
        return await put(self, item)

    async def recorded(self, *args, **kwargs):
        item, waited = await get(self, *args, **kwargs)
        if self.name == "hidden_states":
            taken.append(item.batch.seq)
        return item, waited

    monkeypatch.setattr(target_forward, "forward", reordered)
    monkeypatch.setattr(Channel, "put", arriving)
    monkeypatch.setattr(Channel, "get", recorded)
    three = _chain_losses(tiny_config, 3, "pipeline.in_order=true")
    assert sorted(finished) == sorted(arrived) == list(range(batches))
    assert all(finished.index(k + 1) < finished.index(k) for k in range(0, batches - 1, 3)), finished
    assert arrived.index(1) < arrived.index(0), arrived  # the channel had an early batch to hold
    assert taken == list(range(batches))
    assert three == one


def _chain_losses(tiny_config, chains: int, *extra: str) -> list[float]:
    """The train_step losses of a 64-sample tiny run over `chains` target chains."""
    devices = json.dumps(["cpu"] * chains)
    more = dict(e.split("=", 1) for e in extra)
    cfg = tiny_config(**{"pipeline.target_devices": f"{devices}", "data.num_samples": 64,
                         "run.name": f'"chains{chains}"', "eval.at_end": "false", **more})  # fmt: skip
    return [r["loss"] for r in run_records(cfg, timeout_s=120) if r["event"] == "train_step"]


def test_max_steps_stops_cleanly(tiny_config):
    """train.max_steps ends the run after that many steps, with reason max_steps."""
    records = run_records(tiny_config(**{"train.max_steps": 3, "data.num_samples": 64, **SHORT_EVAL}))
    assert records[-1]["steps"] == 3
    assert records[-1]["event"] == "run_end" and records[-1]["reason"] == "max_steps"


@pytest.mark.parametrize("mode", ["pipeline", "serial"])
def test_max_minutes_ends_the_run_decayed_with_its_reason(tiny_config, monkeypatch, mode):
    """train.max_minutes ends the run once its budget is spent, as at the end of the data —
    exported, reason max_minutes — and the LR schedule follows the clock: it decays to near
    its floor over the budget, though the planned steps are far from done."""
    from dflash.train import schedule

    clock = itertools.count(0.0, 20.0)  # each reading of the clock: 20 s later (5 min: 15 readings)
    monkeypatch.setattr(schedule.TimeBudget, "_now", staticmethod(lambda: next(clock)))
    cfg = tiny_config(**{"train.max_minutes": 5, "pipeline.mode": f'"{mode}"', "data.num_samples": 512,
                         "schedule.min_lr_ratio": 0.1, "eval.at_end": "false"})  # fmt: skip
    records = run_records(cfg)
    end = records[-1]
    assert end["event"] == "run_end" and end["reason"] == "max_minutes"
    steps = [r for r in records if r["event"] == "train_step"]
    assert 2 <= end["steps"] <= 16  # 512 samples: 64 planned steps
    lrs = [r["lr"] for r in steps]
    assert lrs[-1] < 0.2 * cfg.optimizer.lr and lrs[-1] < max(lrs)  # decayed by the clock, not the steps
    assert (cfg.run_dir / "final").is_dir()


def test_max_minutes_not_reached_ends_with_the_data(tiny_config, monkeypatch):
    """A budget the run does not use up (its clock stands still): the run ends with its data
    (reason data_exhausted), and the schedule follows the steps: the LRs of a run without
    a budget."""
    from dflash.train import schedule

    monkeypatch.setattr(schedule.TimeBudget, "_now", staticmethod(lambda: 0.0))
    settings = {"data.num_samples": 32, "eval.at_end": "false"}
    records = run_records(tiny_config(**settings, **{"train.max_minutes": 60}))
    assert records[-1]["reason"] == "data_exhausted"
    unbudgeted = run_records(tiny_config(**settings, **{"run.name": '"plain"'}))
    lrs = [[r["lr"] for r in recs if r["event"] == "train_step"] for recs in (records, unbudgeted)]
    assert lrs[0] == lrs[1] and len(lrs[0]) == 4 and lrs[0][-1] < max(lrs[0])


def test_max_minutes_needs_one_process(tiny_config):
    """train.max_minutes with several processes is refused at set-up, naming the setting (each
    process's clock would end its run at another step)."""
    from dflash.runtime.distributed import World
    from dflash.train.build import build_training

    world = World.__new__(World)
    world.size, world.rank = 2, 0
    with pytest.raises(ConfigError, match=r"train\.max_minutes needs one process"):
        build_training(tiny_config(**{"train.max_minutes": 1}), world=world)


@pytest.mark.parametrize(
    "stage",
    [
        Stage.PREFETCH,
        Stage.TARGET_FORWARD,
        Stage.TARGET_PACK,
        Stage.TARGET_D2H,
        Stage.DRAFTER_FORWARD,
        Stage.OPTIMIZER_STEP,
    ],
)
def test_failing_stage_ends_run_without_hanging(tiny_config, monkeypatch, stage):
    """An exception in any stage ends the run (no hang: the outer timeout is a guard, not a
    speed limit) as a StageError named like the profiler's stage, with the chain index."""
    monkeypatch.setenv("DFLASH_INJECT_FAULT", f"{stage}@2")
    records: list[dict] = []
    with pytest.raises(StageError) as info:
        run_records(tiny_config(), into=records, timeout_s=300)
    task = stage if stage in (Stage.PREFETCH, Stage.OPTIMIZER_STEP) else f"{stage}[0]"
    assert info.value.stage == task
    assert "injected fault" in str(info.value)
    assert records[-1]["event"] == "run_failed" and records[-1]["stage"] == task


class LoopTensorOps(TorchDispatchMode):
    """Counts the tensor operations (aten ops) run on the thread that entered it; the other
    threads' are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if threading.get_ident() == self.thread:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_stop_ends_an_embedded_run_cleanly_and_its_loop_runs_no_tensor_work(tiny_config):
    """The in-process layer of stopping (the CLI's SIGTERM: tests/test_cli.py; torchrun's:
    tests/test_distributed.py). Inside a caller's loop (asyncio debug mode), `stop()` after
    step 4 ends the run after the step in flight: reason "stopped", the steps contiguous up to
    the summary's count, and a checkpoint of that last step. Set-up, batch planning,
    collation, snapshots, writes and joins run in threads: not one tensor operation runs on
    the loop's thread (with set-up moved onto the loop, thousands do)."""
    records: list[dict] = []
    cfg = tiny_config(**{"train.epochs": 50, "checkpoint.every_steps": 2, "eval.at_end": "false"})

    async def main() -> tuple[dict, LoopTensorOps]:
        coord = Coordinator(cfg, log=False)
        coord.subscribe(records.append)
        step4 = asyncio.Event()
        coord.subscribe(lambda r: r["event"] == "train_step" and r["step"] >= 4 and step4.set())
        with LoopTensorOps() as ops:
            run = asyncio.create_task(coord.run())
            await step4.wait()
            coord.stop()
            summary = await run
        return summary, ops

    summary, ops = asyncio.run(main(), debug=True)
    assert summary["reason"] == "stopped" and records[-1] == {"event": "run_end", **summary}
    steps = [r["step"] for r in records if r["event"] == "train_step"]
    assert steps == list(range(1, summary["steps"] + 1)) and 4 <= summary["steps"] < 50 * 4
    latest = latest_checkpoint(cfg.run_dir)
    assert latest is not None and load_checkpoint(latest).step == summary["steps"]
    assert not ops.ops, ops.ops.most_common(10)


def test_no_stray_stdout_from_library(tiny_config, capfd):
    """With log=False the coordinator writes nothing to stdout (embedding programs own it);
    its records still land in the run folder's records.jsonl."""
    cfg = tiny_config(**{"train.max_steps": 1, **SHORT_EVAL})
    _run(cfg)
    out, _ = capfd.readouterr()
    assert out == ""
    saved = [json.loads(line) for line in (cfg.run_dir / "records.jsonl").read_text().splitlines()]
    assert saved[0]["event"] == "run_start" and saved[-1]["event"] == "run_end"


def _spans(trace_path) -> list[tuple[float, float, str]]:
    """(start, end, name) of every compute span of a Chrome trace (waits left out)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    return [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e["ph"] == "X" and e["name"] not in Stage.WAITS]


def _overlaps(spans: list[tuple[float, float, str]]) -> list[tuple[str, str]]:
    spans = sorted(spans)
    return [(a[2], b[2]) for a, b in itertools.pairwise(spans) if b[0] < a[1] - 1.0]  # 1 µs: rounding


def test_serial_mode_is_serial_and_trains_exactly_like_the_pipeline(tiny_config, tmp_path):
    """pipeline.mode = "serial" runs one computation at a time (no two spans of its trace
    overlap, while the pipeline's do) and gives the pipeline's losses and weights exactly —
    also with the drafter preparing its next batch while the optimizer steps."""
    runs = {}
    for mode in ("pipeline", "serial"):
        cfg = tiny_config(**{
            "train.max_steps": 6, "train.epochs": 2, "eval.at_end": "false", "checkpoint.at_end": "true",
            "pipeline.mode": f'"{mode}"', "run.output_dir": f'"{tmp_path / mode}"', "pipeline.prepare_ahead": "true",
            "profile.trace": f'"{tmp_path / mode}.trace.json"',
        })  # fmt: skip
        records = run_records(cfg)
        losses = [r["loss"] for r in records if r["event"] == "train_step"]
        weights = load_file(cfg.run_dir / "checkpoints" / "step_000006" / "drafter.safetensors")
        runs[mode] = (losses, weights, _spans(tmp_path / f"{mode}.trace.json"))
    (la, wa, sa), (lb, wb, sb) = runs["pipeline"], runs["serial"]
    assert la == lb and len(la) == 6
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert len(sb) > 6 * 5 and _overlaps(sb) == []
    assert _overlaps(sa), "the pipeline's stages should overlap (else this check proves nothing)"


def test_failing_end_of_run_eval_is_a_warning_not_a_lost_run(tiny_config, monkeypatch):
    """The drafter is exported before the end-of-run eval; when that eval fails the run still
    ends with run_end (and a warning record), not with an error."""
    monkeypatch.setenv("DFLASH_INJECT_FAULT", f"{Stage.EVAL}@0")
    cfg = tiny_config(**{"train.max_steps": 2, "eval.at_end": "true"})
    records = run_records(cfg)
    warnings = [r["message"] for r in records if r["event"] == "warning"]
    assert any("end-of-run eval failed" in w for w in warnings), warnings
    assert records[-1]["event"] == "run_end" and records[-1]["eval_tau"] is None
    assert (cfg.run_dir / "final" / "model.safetensors").is_file()


def test_what_the_end_needs_is_checked_before_the_first_step(tiny_config, tmp_path):
    """Eval prompts that cannot be read fail the run at set-up, before any training step."""
    from dflash import DataError

    records: list[dict] = []
    with pytest.raises(DataError):
        run_records(tiny_config(**{"eval.prompts": f'"{tmp_path / "missing.jsonl"}"'}), into=records)
    assert not any(r["event"] == "train_step" for r in records)


def test_chains_in_arrival_order_resume_every_batch_once(tiny_config, monkeypatch, tmp_path):
    """By default the drafter takes batches as the chains finish them (here, in each run, the
    forward of the run's first batch waits until its second has reached the hidden-state
    channel): out of prefetch's order. A run stopped after a step that left a gap checkpoints
    the batches done after the gap; resumed from there, every batch of the plan is trained on
    exactly once over the two runs."""
    from dflash.runtime.channel import Channel
    from dflash.stages import target_forward
    from dflash.train.step import Accumulator

    forward, put, add = target_forward.forward, Channel.put, Accumulator.add
    second = threading.Event()  # the run's batch seq 1 reached the hidden-state channel
    arrived: list[int] = []  # Batch.seq, in the order the run's batches reached that channel
    consumed: list[int] = []  # Batch.index, in the order steps consumed them

    def reordered(target, batch, teacher_topk=0):
        if batch.seq == 0:
            assert second.wait(60), "batch 1 never came"  # a hang guard only
        return forward(target, batch, teacher_topk)

    async def arriving(self, item):  # on the event loop: no lock needed
        if self.name == "hidden_states":
            arrived.append(item.batch.seq)
            if item.batch.seq == 1:
                second.set()
        return await put(self, item)

    def counted(self, parts, batch):
        consumed.append(batch.index)
        return add(self, parts, batch)

    def batch_1_came_first() -> bool:
        return 1 in arrived and 0 not in arrived[: arrived.index(1)]

    monkeypatch.setattr(target_forward, "forward", reordered)
    monkeypatch.setattr(Channel, "put", arriving)
    monkeypatch.setattr(Accumulator, "add", counted)
    base = {"pipeline.target_devices": '["cpu", "cpu", "cpu"]', "data.num_samples": 64, "train.epochs": 1,
            "eval.at_end": "false", "checkpoint.every_steps": 1, "checkpoint.keep_last": 20}  # fmt: skip
    first = run_records(tiny_config(**base, **{"train.max_steps": 4}), timeout_s=120)
    assert batch_1_came_first(), arrived
    assert first[-1]["steps"] == 4 and consumed[0] != 0, consumed  # batch 0 waited for batch 1
    gap = [s for s in range(1, 5) if sorted(consumed[:s]) != list(range(s))]  # steps that left a gap
    assert gap and gap[0] == 1, consumed
    run_dir = tiny_config(**base).run_dir
    ckpt = run_dir / "checkpoints" / f"step_{gap[-1]:06d}"
    state = json.loads((ckpt / "state.json").read_text())
    before = consumed[: gap[-1]]
    assert state["cursor"]["index"] == min(set(range(8)) - set(before))
    assert state["cursor"]["done"] == sorted(i for i in before if i > state["cursor"]["index"])
    consumed.clear()
    arrived.clear()
    second.clear()
    other = tiny_config(**base, **{"run.output_dir": f'"{tmp_path / "b"}"'})
    resumed = run_records(other, resume=ckpt, timeout_s=120)
    assert batch_1_came_first(), arrived
    assert resumed[-1]["event"] == "run_end"
    assert sorted(before + consumed) == list(range(8)), (before, consumed)
