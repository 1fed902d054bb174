"""The Coordinator: one run, start to end, inside any event loop.

It owns the run, not its parts: set-up (dflash/train/build.py) builds the `Training` in a
worker thread, the topology (dflash/pipeline/topology.py) wires channels, devices and stage tasks,
and the coordinator runs them in one TaskGroup — the first stage to fail cancels the
others and comes out as one StageError naming it — then tears down in a fixed order
(profiler, trace, devices) and ends the run: export, end-of-run eval, summary. Step hooks
(eval, checkpoints) and record subscribers (the progress line; the run folder's log is written
by `emit` itself) are attached here. `stop()` (Ctrl-C, SIGTERM, or a caller) acts on the run's `phase`: during
set-up, set-up ends at its next phase boundary and the run ends without training; while
training, intake stops, the in-flight optimizer step finishes, queued work is dropped; after
the last step (`"finishing"`), the export is kept and the end-of-run eval ends at its next
decoding step. `run_end` says which (`stopped_during`, `eval_stopped`). Nothing here runs on
the event loop longer than a record's bookkeeping: models, data, writes and joins run in threads.

Every record is stamped once (its `level` by its event, `logs.level_of`, and its time) and
rendered once: stdout and the run folder's `records.jsonl` get the same line. When `run`
returns or raises, the run has left nothing behind in the embedding program: its worker
threads joined (a failed run's too, after its `run_failed` record: each worker's call in hand
waited for up to `JOIN_S`, one that hangs named in a warning), a checkpoint write in
flight finished, its files closed (the run folder's log, the feature store's parts), the
targets' own engines ended (also when set-up fails after making them), and the monitor
threads of progress bars it started stopped.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from dflash import logs
from dflash.config import Config, dump_toml
from dflash.errors import ConfigError
from dflash.eval.decode import EvalStopped
from dflash.logs import ProgressLine, RunLog
from dflash.model.drafter import DFlashDrafter
from dflash.model.export import export_drafter, speculative_config
from dflash.pipeline import topology
from dflash.roofline.peaks import peaks_of
from dflash.runtime import distributed, faults
from dflash.runtime.devices import Device, DeviceFactory, set_sync_debug
from dflash.runtime.distributed import World
from dflash.runtime.profiler import Profiler, Trace
from dflash.stages._link import root_error, stage_task
from dflash.trackers import Trackers, open_trackers
from dflash.train.build import SetupStopped, Training, build_training, stopping_setup
from dflash.train.checkpoint import Checkpointer, ResumeFrom, write_run_gguf
from dflash.train.hooks import EvalHook, StepHook, SyncDebugHook

__all__ = ["Coordinator", "Record"]

Record = dict[str, Any]
JOIN_S = 60.0  # after a failure, how long the workers' calls in hand are waited for


class Coordinator:
    """Runs one training job. `await Coordinator(cfg).run()` inside any event loop."""

    def __init__(
        self,
        config: Config,
        *,
        log: bool = True,
        resume: ResumeFrom | str | Path | None = None,
        training: Training | None = None,
        make_device: DeviceFactory = Device,
    ) -> None:
        """`resume`: a checkpoint folder, or "auto" for the latest complete one in the run folder
        (a `train.checkpoint.ResumeFrom`, or its folder / "auto" alone).
        `training`: run on this `Training` instead of building one from the config (set-up
        skipped; e.g. the stand-ins of known cost in `bench/simulated.py`). `make_device`: how
        the pipeline makes each `Device` (`runtime.devices.DeviceFactory`): `Device` itself,
        or a subclass that runs the same stages on other semantics (a simulated device queue)."""
        self.config = config
        self.resume = resume
        self._given = training
        self._make_device = make_device
        self.run_dir = config.run_dir
        self._log = structlog.get_logger("dflash") if log else None
        self._subscribers: list[Callable[[Record], None]] = []
        self._run_log: RunLog | None = None  # the run folder's records.jsonl, while the run runs
        self._trackers: Trackers | None = None  # run.trackers' subscriber, while the run runs
        self._stop_requested = threading.Event()
        self._stop_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.replicas: list[Any] = []
        self.targets: list[Any] = []
        self.steps = 0
        self.summary: Record | None = None
        self.phase = "setup"  # then "training" (the stage tasks), "finishing" (export, end-of-run eval)
        self._stopped_during: str | None = None  # the phase the first stop() came in
        self._topology: topology.Topology | None = None
        self.world: World | None = None  # set when torchrun launched several processes

    @property
    def tokens(self) -> int:
        """Tokens of the steps reported so far."""
        return self._topology.book.tokens if self._topology else 0

    @property
    def last_step(self) -> Record | None:
        """The last `train_step` record."""
        return self._topology.book.last if self._topology else None

    # -- records ------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[Record], None]) -> None:
        """`fn(record)` is called (on the loop thread) for every record the run emits: `event`
        and its fields (its level: `logs.level_of(record)`; `run_end`'s is the summary `run` returns)."""
        self._subscribers.append(fn)

    def emit(self, event: str, level: str | None = None, **fields: Any) -> None:
        """One record: stamped once (`level`: the event's own, `logs.level_of`, unless given),
        rendered once, the same line on stdout and in the run folder, then to the subscribers."""
        if self.world is not None:  # several processes: every record says whose it is
            fields = {"rank": self.world.rank, **fields}
        given = {"event": event, **fields} if level is None else {"event": event, **fields, "level": level}
        record = logs.stamp(given)
        line = logs.render(record)
        if self._log is not None and not logs.write_line(line, record["level"]):
            # structlog configured by the embedding program: the record goes its way, stamped
            log = getattr(self._log, record["level"], self._log.info)
            log(event, **{k: v for k, v in record.items() if k != "event"})
        if self._run_log is not None:
            self._run_log.write_line(line)
        for fn in self._subscribers:
            fn(dict(given))

    # -- control ------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the run to stop cleanly (what that means depends on `phase`). Safe from any
        thread and from signal handlers."""
        if not self._stop_requested.is_set():
            self._stopped_during = self.phase
        self._stop_requested.set()
        loop, ev = self._loop, self._stop_event
        if loop is not None and ev is not None and not loop.is_closed():
            loop.call_soon_threadsafe(ev.set)

    # -- the run ------------------------------------------------------------------------
    async def run(self) -> Record:
        self._loop = asyncio.get_running_loop()
        threads = frozenset(threading.enumerate())  # what the embedding program had: kept
        faults.configure()
        stop = self._stop_event = asyncio.Event()
        if self._stop_requested.is_set():
            stop.set()
        t_start = time.perf_counter()
        try:
            self.world = await asyncio.to_thread(distributed.join, self.config)
            clean = False
            try:
                run_log = self._run_log = await asyncio.to_thread(self._open_run_dir)
                try:
                    await self._open_trackers()
                    try:
                        summary = await self._run(stop, t_start)
                        clean = True
                        return summary
                    finally:  # a failed run's (a finished one closed them before run_end)
                        await self._close_trackers(self._trackers)
                finally:
                    self._run_log = None
                    run_log.close()
            finally:
                if self.world is not None:
                    await asyncio.to_thread(self.world.close, clean)
        finally:
            logs.stop_monitors(threads)  # bars of other libraries (downloads, datasets) done by now

    async def _open_trackers(self) -> None:
        """`run.trackers`, started before any step (one that cannot start: one line, exit 2) and
        subscribed to the records; under torchrun on rank 0 (`run.trackers_all_ranks`: each)."""
        cfg = self.config
        rank = self.world.rank if self.world is not None else 0
        if not cfg.run.trackers or (rank and not cfg.run.trackers_all_ranks):
            return
        by_rank = rank if cfg.run.trackers_all_ranks and self.world is not None else None
        name = cfg.run.name if by_rank is None else f"{cfg.run.name}.rank{rank}"
        opened = await asyncio.to_thread(
            open_trackers, list(cfg.run.trackers), self.run_dir, name, cfg.model_dump(mode="json"), by_rank
        )
        self._trackers = Trackers(opened, lambda why: self.emit("warning", message=why))
        self.subscribe(self._trackers)

    async def _close_trackers(self, hub: Trackers | None) -> None:
        """What is queued written and every tracker closed, its thread joined: before `run_end`
        (so a tracker's last failure is a `warning` before it), or as a failed run ends."""
        if hub is None:
            return
        self._trackers = None
        if hub in self._subscribers:
            self._subscribers.remove(hub)
        await asyncio.to_thread(hub.close)
        hub.report()  # a tracker that failed at the end: its warning, on this thread

    def _open_run_dir(self) -> RunLog:
        """The run folder, its resolved config and its copy of the records (a run folder is
        complete on its own)."""
        cfg = self.config
        trace_dir = Path(cfg.profile.trace).expanduser().parent if cfg.profile.trace else None
        if trace_dir is not None and not trace_dir.is_dir():
            msg = f"profile.trace: folder {trace_dir} does not exist"
            raise ConfigError(msg)
        rank = self.world.rank if self.world is not None else 0
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if rank == 0:
                (self.run_dir / "config.toml").write_text(dump_toml(cfg))
            return RunLog(self.run_dir / ("records.jsonl" if rank == 0 else f"records.rank{rank}.jsonl"))
        except OSError as err:
            msg = f"run.output_dir: cannot write the run folder {self.run_dir}: {err.strerror or err}"
            raise ConfigError(msg) from None

    async def _run(self, stop: asyncio.Event, t_start: float) -> Record:
        cfg = self.config
        w = self.world
        where = {"world_size": w.size, "backend": w.backend} if w is not None else {}
        self.emit(
            "run_start", run_dir=str(self.run_dir), torch=torch.__version__, **where, config=cfg.model_dump(mode="json")
        )
        training = self._given or await self._setup()
        if training is None:  # a stop came during set-up
            return await self._end({"reason": "stopped", "steps": 0}, t_start)
        self.targets, self.replicas = training.targets, training.replicas
        try:
            topo, checkpointer, profiler, trace = await self._prepare(training, stop, t_start)
        except BaseException:  # a live engine or remote server made by set-up ends with the run
            await self._close_targets(training)
            raise
        progress = ProgressLine(training.total_steps, training.start_step)
        self.subscribe(progress)
        t_train = time.perf_counter()
        if training.steps.budget is not None:
            training.steps.budget.start()
        self.phase = "training"
        try:
            error = await self._train(topo, profiler, trace)
        finally:
            self._subscribers.remove(progress)
            progress.close()
            await self._close_targets(training)
            if topo.store is not None:  # its open parts (it opens them again if read again)
                topo.store.close()
        if error is not None:
            try:
                await self._fail(error, checkpointer, topo)
            finally:  # the workers not waited for at the failure: joined once the records are out
                await self._join_workers(topo)
        train_s = time.perf_counter() - t_train
        self.steps = topo.book.progress.step
        self.phase = "finishing"
        return await self._finish(training, topo, stop.is_set(), t_start, train_s)

    async def _prepare(
        self, training: Training, stop: asyncio.Event, t_start: float
    ) -> tuple[topology.Topology, Checkpointer, Profiler, Trace | None]:
        """From a built `Training` to the wired topology: the `setup` record, the profiler (and
        the devices' peaks), the checkpointer and the step hooks."""
        cfg = self.config
        self._emit_setup(training, t_start)
        trace = Trace(cfg.profile.trace, cfg.profile.trace_max_events) if cfg.profile.trace else None
        profiler = Profiler(cfg.profile.interval_s, self.emit, enabled=cfg.profile.enabled, trace=trace)
        profiler.count_flops = cfg.profile.mfu
        if cfg.profile.enabled and cfg.profile.mfu:  # each device's matmul peak: measured once, cached
            profiler.peaks = await asyncio.to_thread(peaks_of, training.targets, training.replicas, cfg.data.cache_dir)
        checkpointer = Checkpointer(
            cfg, training.replicas[0], training.plan, self.emit, training.start_step, self.world, training.batch
        )
        hooks: list[StepHook] = []
        if training.evaluate is not None and cfg.eval.every_steps:
            # a stop asked here, or agreed with another rank (`stop`): both end an eval in progress
            asked = lambda: self._stop_requested.is_set() or stop.is_set()  # noqa: E731
            hooks.append(EvalHook(cfg.eval.every_steps, training.evaluate, self.emit, asked))
        hooks.append(checkpointer)
        if self.world is not None and cfg.distributed.check_every:
            hooks.append(distributed.SameWeights(self.world, training.replicas[0].params, cfg.distributed.check_every))
        if cfg.pipeline.sync_debug:
            hooks.append(SyncDebugHook(training.start_step + 3))
        topo = self._topology = topology.build(cfg, training, profiler, self.emit, stop, hooks, self._make_device)
        return topo, checkpointer, profiler, trace

    @staticmethod
    async def _close_targets(training: Training) -> None:
        """Each target's own engine ended (a live vLLM engine's process; a remote server told the
        run is over); a local target has nothing to close."""
        for tgt in training.targets:
            close = getattr(tgt, "close", None)
            if callable(close):
                await asyncio.to_thread(close)

    async def _join_workers(self, topo: topology.Topology) -> None:
        """After a failure: each worker waited for until its call in hand ends, for at most
        `JOIN_S` in all; one still running then (a call that hangs) is named in a warning and left."""
        deadline = time.monotonic() + JOIN_S
        for d in topo.devices:
            left = await asyncio.to_thread(d.join, max(0.0, deadline - time.monotonic()))
            if left:
                busy = ", ".join(left)
                self.emit("warning", message=f"worker {busy} still busy {JOIN_S:g} s after the failure: left running")

    async def _setup(self) -> Training | None:
        """Set-up in a worker thread (`build_training`); None when a stop was asked before it
        or came during it (set-up ends at its next phase boundary: `stopping_setup`). With
        several processes set-up always completes: the ranks, which may see a signal at
        different phases, then agree to stop before the first step, all together."""
        if self.world is not None:
            return await asyncio.to_thread(build_training, self.config, self.resume, self.world)
        if self._stop_requested.is_set():
            return None
        try:
            with stopping_setup(self._stop_requested.is_set):
                return await asyncio.to_thread(build_training, self.config, self.resume, self.world)
        except SetupStopped:
            return None

    def _emit_setup(self, training: Training, t_start: float) -> None:
        for w in training.warnings:
            self.emit("warning", message=w)
        if training.resumed is not None:
            self.emit("resume", **training.resumed)
        self.emit(
            "setup",
            samples=len(training.plan.samples),
            data=training.data_stats,
            batches_per_epoch=training.plan.batches_per_epoch,
            padding_fraction=round(training.padding_fraction, 4),
            batch_shape=training.batch_shape,
            total_steps=training.total_steps,
            target=training.targets[0].name,
            target_dtype=training.targets[0].dtype_name,
            target_layers=training.spec.target_layer_ids,
            drafter_params=sum(p.numel() for p in training.replicas[0].params),
            mask_token_id=training.spec.mask_token_id,
            setup_s=round(time.perf_counter() - t_start, 3),
            resumed_from=training.start_step if self.resume is not None else None,
        )

    async def _train(self, topo: topology.Topology, profiler: Profiler, trace: Trace | None) -> BaseException | None:
        """Every stage task in one TaskGroup; then teardown in a fixed order: profiler (last
        window), trace file, devices. Returns the root error, if any."""
        prof_stop = asyncio.Event()
        prof_task = asyncio.create_task(profiler.run(prof_stop), name="profiler")
        error: BaseException | None = None
        clean = False
        try:
            async with asyncio.TaskGroup() as tg:
                for name, coro in topo.tasks:
                    tg.create_task(stage_task(name, coro), name=name)
            clean = True
        except BaseExceptionGroup as eg:
            error = root_error(eg)
        finally:
            set_sync_debug(False)  # the end of the run may sync as it likes
            prof_stop.set()
            await prof_task
            profiler.emit_window(final=True)
            if trace is not None:
                try:
                    await asyncio.to_thread(trace.write)
                except OSError as err:
                    self.emit("warning", message=f"trace not written to {trace.path}: {err.strerror or err}")
            # After a failure wait only for the optimizer's op in flight (no half update); the other
            # workers are joined once the failure's records are out (`_join_workers`).
            for d in topo.devices:
                await asyncio.to_thread(d.close, clean or d is topo.optimizer)
        return error

    async def _fail(self, error: BaseException, checkpointer: Checkpointer, topo: topology.Topology) -> None:
        ckpt = self.config.checkpoint
        if isinstance(error, Exception):
            try:  # a checkpoint write still in flight ends first (its thread, its files)
                await checkpointer.finish()
            except Exception as err:  # never hide the original error behind this one
                self.emit("warning", message=f"checkpoint not written: {' '.join(str(err).split())}")
        if isinstance(error, Exception) and (ckpt.at_end or ckpt.every_steps or ckpt.every_minutes):
            # The last consistent state (weights, optimizer, cursor of the last finished step).
            try:
                path = await asyncio.to_thread(checkpointer.emergency, topo.book.progress)
            except Exception as err:  # never hide the original error behind this one
                self.emit("warning", message=f"emergency checkpoint failed: {err}")
            else:
                if path is not None:
                    self.emit("checkpoint", step=checkpointer.last_step, path=str(path), emergency=True)
        if isinstance(error, Exception):
            self.emit("run_failed", error=str(error), stage=getattr(error, "stage", None))
        raise error

    async def _finish(
        self, training: Training, topo: topology.Topology, stopped: bool, t_start: float, train_s: float
    ) -> Record:
        """The end of a finished run: export first (a trained drafter is never lost), then
        the end-of-run eval (a failing eval is a warning, not a lost run), then the summary."""
        cfg, book = self.config, topo.book
        trained = self.steps > 0
        writer = self.world is None or self.world.is_writer  # with several ranks, rank 0 exports
        export_dir = None
        if cfg.checkpoint.export_final and trained and writer:
            export_dir = self.run_dir / "final"
            await asyncio.to_thread(export_drafter, training.replicas[0].model, export_dir)
            self.emit("export", step=self.steps, path=str(export_dir))
            if cfg.checkpoint.export_gguf:
                await asyncio.to_thread(self._export_gguf, training.replicas[0].model)
        eval_record, eval_stopped = None, False
        if cfg.eval.at_end and trained and not stopped and training.evaluate is not None:
            eval_record, eval_stopped = await self._end_eval(training)
        if stopped:
            reason = "stopped"
        elif cfg.train.max_steps and self.steps >= cfg.train.max_steps:
            reason = "max_steps"
        elif (
            training.steps.budget is not None and training.steps.budget.spent
        ):  # the last step's reading: export, eval leave it
            reason = "max_minutes"
        else:
            reason = "data_exhausted"
        last = book.last
        return await self._end(
            {
                "reason": reason,
                "steps": self.steps,
                "train_s": round(train_s, 3),
                "tokens": book.tokens,
                "tokens_per_s": round(book.tokens / train_s, 2) if train_s > 0 else 0.0,
                "feature_cache": topo.cache.stats() if topo.cache is not None else None,
                "feature_store": topo.store.stats() if topo.store is not None else None,
                "target_engine": next((t.stats() for t in self.targets if hasattr(t, "stats")), None),
                "final_loss": last["loss"] if last else None,
                "final_tau_sim": last["tau_sim"] if last else None,
                "eval_tau": eval_record["tau"] if eval_record else None,
                "eval_lossless": eval_record["lossless"] if eval_record else None,
                "eval_stopped": eval_stopped,
                "export_dir": str(export_dir) if export_dir else None,
                "vllm_speculative_config": speculative_config(export_dir.resolve(), training.spec)
                if export_dir
                else None,
            },
            t_start,
        )

    def _export_gguf(self, model: DFlashDrafter) -> None:
        """<run>/final.gguf for llama.cpp (checkpoint.export_gguf); a failure is a warning: the
        drafter is in <run>/final already (`dflash export <run> OUT.gguf --format gguf` again)."""
        out = self.run_dir / "final.gguf"
        try:
            write_run_gguf(self.config, model, out)
        except Exception as err:  # the drafter is in <run>/final: a warning, not a lost run
            why = " ".join(str(err).split()) or type(err).__name__
            self.emit("warning", message=f"final.gguf not written: {why}")
            return
        self.emit("export", step=self.steps, path=str(out), format="gguf", gguf_type=self.config.checkpoint.export_gguf)

    async def _end_eval(self, training: Training) -> tuple[Record | None, bool]:
        """The end-of-run eval: its record, and whether a stop ended it first (it asks once per
        decoding step, so Ctrl-C here ends it promptly)."""
        assert training.evaluate is not None
        try:
            record = await asyncio.to_thread(training.evaluate, self.steps, self._stop_requested.is_set)
        except EvalStopped:
            return None, True
        except Exception as err:
            self.emit("warning", message=f"end-of-run eval failed: {' '.join(str(err).split())}")
            return None, False
        self.emit("eval", **record)
        return record, False

    async def _end(self, fields: Record, t_start: float) -> Record:
        """The `run_end` record (also the summary `run` returns). `stopped_during`: the phase the
        first stop came in ("setup", "training", "finishing"), None without a stop."""
        during = self._stopped_during
        if during is None and fields["reason"] == "stopped":  # another rank's stop (distributed.World)
            during = "training"
        self.summary = {
            "reason": fields.pop("reason"),
            "steps": fields.pop("steps"),
            "wall_s": round(time.perf_counter() - t_start, 3),
            "train_s": 0.0,
            "tokens": 0,
            "tokens_per_s": 0.0,
            "feature_cache": None,
            "feature_store": None,
            "target_engine": None,
            "final_loss": None,
            "final_tau_sim": None,
            "eval_tau": None,
            "eval_lossless": None,
            "eval_stopped": False,
            "stopped_during": during,
            "export_dir": None,
            "vllm_speculative_config": None,
            **fields,
            "run_dir": str(self.run_dir),
            "trackers": {},
        }
        hub = self._trackers
        await self._close_trackers(hub)  # their last writes, and any failure's warning
        self.summary["trackers"] = hub.where if hub is not None else {}  # those that lasted: where to look
        self.emit("run_end", **self.summary)
        return self.summary
