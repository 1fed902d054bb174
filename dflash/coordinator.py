"""The Coordinator: builds the topology, owns the TaskGroup, and turns failures into one error.

Topology (one process, one event loop):

    prefetch ─► [batches] ─┬─► target_forward₀ ─► pack₀ ─► transfer₀ ─┐
                           └─► target_forward₁ ─► pack₁ ─► transfer₁ ─┴─► [hidden_states]
    [hidden_states] ─┬─► drafter_step₀ ─┐
                     └─► drafter_step₁ ─┴─► [grads] ─► optimizer ─► [replies₀], [replies₁]

One target chain per `pipeline.target_devices` entry, one drafter replica per
`pipeline.drafter_devices` entry. Every stage is a task of one TaskGroup; the first to fail
cancels the others and comes out as a StageError naming it. `stop()` (Ctrl-C, SIGTERM, or
a caller) stops intake; the in-flight optimizer step finishes, queued work is dropped.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from dflash import faults
from dflash import synthetic as synth
from dflash.channel import Channel, ChannelClosed, ConsumerDied
from dflash.checkpoint import Checkpointer, Loaded, check_compatible, latest_checkpoint, load_checkpoint, restore
from dflash.config import Config, dump_toml
from dflash.data.batching import BatchPlan, Sample
from dflash.data.synthetic import random_samples, synthesize
from dflash.devices import Device, check_device
from dflash.errors import CheckpointError, ConfigError, DataError, StageError
from dflash.eval import eval_prompts, evaluate, stop_ids
from dflash.export import export_drafter
from dflash.feature_cache import FeatureCache
from dflash.model.drafter import DrafterSpec, FrozenHead
from dflash.model.loading import load_tokenizer
from dflash.model.target import Target, load_target
from dflash.profile import Profiler, Trace
from dflash.records import Batch, HostFeatures, PackedFeatures, StepGrads, StepReply, TargetFeatures
from dflash.replica import DrafterReplica, build_replicas
from dflash.stages import drafter_step, optimizer, pack, prefetch, target_forward, transfer
from dflash.synthetic import SyntheticSpec

__all__ = ["Coordinator", "Record"]

Record = dict[str, Any]


@dataclass
class _Setup:
    targets: list[Target]
    replicas: list[DrafterReplica]
    plan: BatchPlan
    spec: DrafterSpec
    total_steps: int
    padding_fraction: float  # epoch 0's padded share of the R × T slots
    start_step: int = 0  # > 0 when resumed


def _flatten(eg: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in eg.exceptions:
        out.extend(_flatten(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


class Coordinator:
    """Runs one training job. `await Coordinator(cfg).run()` inside any event loop."""

    def __init__(
        self,
        config: Config,
        *,
        log: bool = True,
        resume: str | Path | None = None,
        synthetic: SyntheticSpec | None = None,
    ) -> None:
        """`resume`: a checkpoint folder, or "auto" for the latest complete one in the run folder.
        `synthetic`: replace the models' compute with work of known cost (orchestration benchmarks)."""
        self.config = config
        self.resume = resume
        self.synthetic = synthetic
        self.run_dir = config.run_dir
        self._log = structlog.get_logger("dflash") if log else None
        self._subscribers: list[Callable[[Record], None]] = []
        self._stop_requested = threading.Event()
        self._stop_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.replicas: list[DrafterReplica] = []
        self.tokenizer: Any = None
        self._eval_prompts: list[torch.Tensor] | None = None
        self._data_stats: dict[str, Any] = {}
        self.targets: list[Target] = []
        self.steps = 0
        self.tokens = 0
        self._t_train = time.perf_counter()
        self._start_step = 0
        self.last_step: Record | None = None
        self.summary: Record | None = None

    # -- records ------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[Record], None]) -> None:
        """`fn(record)` is called (on the loop thread) for every record the run emits."""
        self._subscribers.append(fn)

    def emit(self, event: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.info(event, **fields)
        for fn in self._subscribers:
            fn({"event": event, **fields})

    def _emit_steps(self, records: list[Record]) -> None:
        for r in records:
            self.emit("train_step", **r)
            self.last_step = r
            self.tokens += r["tokens"]
        if records and sys.stderr.isatty():  # progress for people; stdout stays pure JSON
            r = records[-1]
            el = time.perf_counter() - self._t_train
            done = r["step"] - self._start_step
            rate = self.tokens / el if el > 0 else 0.0
            left = (self._total_steps - r["step"]) * el / done if done and isinstance(self._total_steps, int) else 0
            loss = f"{r['loss']:.4f}" if r["loss"] is not None else "nan"
            print(
                f"\rstep {r['step']}/{self._total_steps} loss {loss} tau_sim {r['tau_sim']:.2f} "
                f"{rate:.0f} tok/s ETA {left / 60:.1f} min   ",
                end="",
                file=sys.stderr,
                flush=True,
            )

    # -- control ------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the run to stop cleanly. Safe from any thread and from signal handlers."""
        self._stop_requested.set()
        loop, ev = self._loop, self._stop_event
        if loop is not None and ev is not None and not loop.is_closed():
            loop.call_soon_threadsafe(ev.set)

    # -- set-up (in a worker thread: loading models must not block the loop) ------------
    def _setup(self) -> _Setup:
        cfg = self.config
        torch.manual_seed(cfg.run.seed)
        t_devs = [check_device(d, f"pipeline.target_devices[{i}]") for i, d in enumerate(cfg.pipeline.target_devices)]
        d_devs = [check_device(d, f"pipeline.drafter_devices[{i}]") for i, d in enumerate(cfg.pipeline.drafter_devices)]
        if cfg.drafter.attention == "flex" and any(d.type == "cpu" for d in d_devs):
            msg = (
                "drafter.attention = 'flex': flex attention has no backward on CPU in this torch; "
                "use 'auto' (flex on CUDA, dense SDPA on CPU) or 'sdpa'"
            )
            raise ConfigError(msg)
        loaded = self._load_resume()  # before loading any model: a bad checkpoint fails in a second
        if cfg.data.source == "files":  # likewise a missing data file
            for i, f in enumerate(cfg.data.files):
                if not Path(f.path).expanduser().exists():
                    msg = f"data.files[{i}]: dataset not found: {f.path}"
                    raise DataError(msg)
        cache = cfg.data.cache_dir
        self.tokenizer = load_tokenizer(cfg.target, cache)
        targets = [load_target(cfg.target, dev, cfg.drafter.num_layers, cache) for dev in t_devs]
        t0 = targets[0]
        mask_id = cfg.drafter.mask_token_id
        if mask_id is None:
            if cfg.target.kind != "tiny":
                msg = "drafter.mask_token_id: required for a real target (an existing, unused token id)"
                raise ConfigError(msg)
            mask_id = t0.vocab_size - 1
        if mask_id >= t0.vocab_size:
            msg = (
                f"drafter.mask_token_id: {mask_id} is outside the target's embedding "
                f"(vocab size {t0.vocab_size}; ids 0..{t0.vocab_size - 1})"
            )
            raise ConfigError(msg)
        head = FrozenHead(t0.embed_weight, t0.lm_head_weight)
        row, mean = head.norm_of_row(mask_id), head.mean_row_norm()
        if row < 0.1 * mean:
            self._warn_later(
                f"drafter.mask_token_id {mask_id}: its embedding row is near zero "
                f"(norm {row:.3g} vs mean {mean:.3g}); the drafter cannot tell mask slots apart"
            )
        if cfg.data.source != "files":
            samples = (
                synthesize(cfg.data, t0, cfg.run.seed, exclude_token=mask_id)
                if cfg.data.source == "synthetic"
                else random_samples(cfg.data, t0.vocab_size, cfg.run.seed, exclude_token=mask_id)
            )
            self._data_stats = {"samples": len(samples)}
        else:
            if self.tokenizer is None:
                msg = "data.source = 'files' needs a target with a tokenizer (target.kind = 'hf' or 'gguf')"
                raise ConfigError(msg)
            from dflash.data.tokenize import load_samples

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                samples, self._data_stats = load_samples(cfg.data, self.tokenizer, progress=sys.stderr.isatty())
            for w in caught:  # skipped records, an unwritable cache: warning records, not stderr noise
                self._warn_later(str(w.message))
        if not samples:
            msg = "data: no samples to train on"
            raise DataError(msg)
        uses = sum(int((s.input_ids == mask_id).sum()) for s in samples)
        if uses:
            self._warn_later(
                f"drafter.mask_token_id {mask_id} occurs {uses} times in the training data; "
                "an id the data never uses is better"
            )
        plan = BatchPlan.from_config(
            samples, cfg.data, cfg.train.epochs, cfg.run.seed, start=loaded.cursor if loaded else None
        )
        per_step = cfg.train.grad_accum * len(d_devs)
        total = cfg.train.max_steps or max(1, math.ceil(len(plan) / per_step))
        spec = DrafterSpec(
            hidden_size=t0.hidden_size,
            num_layers=cfg.drafter.num_layers,
            num_heads=t0.num_heads,
            num_kv_heads=t0.num_kv_heads,
            head_dim=t0.head_dim,
            intermediate_size=cfg.drafter.intermediate_size or t0.intermediate_size,
            vocab_size=t0.vocab_size,
            rms_norm_eps=t0.rms_norm_eps,
            rope_theta=t0.rope_theta,
            target_layer_ids=t0.layer_ids,
            num_target_layers=t0.num_layers,
            block_size=cfg.drafter.block_size,
            mask_token_id=mask_id,
            layer_types=cfg.drafter.resolved_layer_types,
            sliding_window=cfg.drafter.sliding_window,
            sliding_causal_block=cfg.drafter.sliding_causal_block,
        )
        init_from = t0.model if cfg.drafter.init_from_target else None
        replicas = build_replicas(spec, head, d_devs, cfg.train, total, cfg.run.seed, init_from)
        if loaded is not None:
            restore(loaded, replicas)
            padding = plan.padding_fraction(0)
            return _Setup(targets, replicas, plan, spec, total, padding, start_step=loaded.step)
        # Here, in the set-up thread: laying out epoch 0 is work the event loop must not do.
        return _Setup(targets, replicas, plan, spec, total, plan.padding_fraction(0))

    def _evaluate(self, step: int) -> Record:
        """Speculative decoding with replica 0 against target 0 on held-out prompts."""
        cfg, target, rep = self.config, self.targets[0], self.replicas[0]
        if self._eval_prompts is None:
            self._eval_prompts = eval_prompts(cfg, target, self.tokenizer, rep.model.spec.mask_token_id)
        stops = stop_ids(target, self.tokenizer)
        record = evaluate(target, rep.model, rep.head, self._eval_prompts, cfg.eval.max_new_tokens, stops)
        return {"step": step, **record}

    def _setup_synthetic(self) -> _Setup:
        """Stand-ins for targets, data and replicas; the stages, channels and devices are real."""
        cfg, spec = self.config, self.synthetic
        assert spec is not None
        targets = [synth.SyntheticTarget(spec.target) for _ in cfg.pipeline.target_devices]
        replicas = [synth.SyntheticReplica(i, torch.device("cpu")) for i in range(len(cfg.pipeline.drafter_devices))]
        samples = [
            Sample(i, torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.bool)) for i in range(spec.batches)
        ]
        plan = BatchPlan(samples, 1, 1, cfg.run.seed, False)
        dspec = DrafterSpec(
            hidden_size=1, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, intermediate_size=1, vocab_size=1,
            rms_norm_eps=1e-6, rope_theta=1.0, target_layer_ids=[0], num_target_layers=1,
            block_size=spec.block_size, mask_token_id=0, layer_types=["full_attention"], sliding_window=1,
        )  # fmt: skip
        total = math.ceil(spec.batches / len(replicas))
        return _Setup(targets, replicas, plan, dspec, total, 0.0)  # type: ignore[arg-type]

    def _load_resume(self) -> Loaded | None:
        if self.resume is None:
            return None
        cfg = self.config
        if str(self.resume) == "auto":
            path = latest_checkpoint(cfg.run_dir)
            if path is None:
                msg = f"--resume auto: no complete checkpoint in {cfg.run_dir / 'checkpoints'}"
                raise CheckpointError(msg)
        else:
            path = Path(self.resume).expanduser()
        loaded = load_checkpoint(path)
        check_compatible(loaded.config, cfg, path)
        return loaded

    def _warn_later(self, message: str) -> None:
        self._warnings.append(message)

    # -- the run ------------------------------------------------------------------------
    async def run(self) -> Record:
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        faults.configure()
        self._stop_event = asyncio.Event()
        if self._stop_requested.is_set():
            self._stop_event.set()
        self._warnings: list[str] = []
        self._total_steps: int | str = "?"
        t_start = time.perf_counter()
        trace_dir = Path(cfg.profile.trace).expanduser().parent if cfg.profile.trace else None
        if trace_dir is not None and not trace_dir.is_dir():
            msg = f"profile.trace: folder {trace_dir} does not exist"
            raise ConfigError(msg)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(dump_toml(cfg))
        except OSError as err:
            msg = f"run.output_dir: cannot write the run folder {self.run_dir}: {err.strerror or err}"
            raise ConfigError(msg) from None
        self.emit(
            "run_start",
            run_dir=str(self.run_dir),
            torch=torch.__version__,
            config=cfg.model_dump(mode="json"),
        )
        setup = self._setup_synthetic() if self.synthetic else await asyncio.to_thread(self._setup)
        for w in self._warnings:
            self.emit("warning", message=w)
        self.targets, self.replicas = setup.targets, setup.replicas
        self._total_steps = setup.total_steps
        self.emit(
            "setup",
            samples=len(setup.plan.samples),
            data=self._data_stats,
            batches_per_epoch=setup.plan.batches_per_epoch,
            padding_fraction=round(setup.padding_fraction, 4),
            total_steps=setup.total_steps,
            target=setup.targets[0].name,
            target_layers=setup.spec.target_layer_ids,
            drafter_params=sum(p.numel() for p in getattr(setup.replicas[0], "params", [])),
            mask_token_id=setup.spec.mask_token_id,
            setup_s=round(time.perf_counter() - t_start, 3),
            resumed_from=setup.start_step if self.resume is not None else None,
        )

        trace = Trace(cfg.profile.trace, cfg.profile.trace_max_events) if cfg.profile.trace else None
        profiler = Profiler(cfg.profile.interval_s, self.emit, enabled=cfg.profile.enabled, trace=trace)
        devices: list[Device] = []

        # Serial mode: one worker thread for every stage, so no two computations overlap.
        shared = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-serial")
            if cfg.pipeline.mode == "serial"
            else None
        )

        def device(spec: str, name: str) -> Device:
            d = Device(spec, name, profiler, executor=shared)
            if self.synthetic is not None and self.synthetic.device_model == "async":
                d.sim = synth.Timeline()
            devices.append(d)
            return d

        stop = self._stop_event
        n_t, n_d = len(setup.targets), len(setup.replicas)
        p = cfg.pipeline
        batches: Channel[Batch] = Channel("batches", p.batch_queue_depth, consumers=n_t)
        hs: Channel[HostFeatures] = Channel(
            "hidden_states", p.hs_queue_depth, producers=n_t, consumers=n_d, min_ready=p.hs_min_ready
        )
        grads: Channel[StepGrads] = Channel("grads", n_d, producers=n_d)
        replies: list[Channel[StepReply]] = [Channel(f"replies{r}", 1) for r in range(n_d)]
        profiler.add_channel(batches)
        profiler.add_channel(hs)
        any_cuda = any(r.device.type == "cuda" for r in setup.replicas) or any(
            t.device.type == "cuda" for t in setup.targets
        )
        use_flex = cfg.drafter.attention == "flex" or (
            cfg.drafter.attention == "auto" and setup.replicas[0].device.type == "cuda"
        )

        t_cfg, total = cfg.train, setup.total_steps

        def noise(step: int) -> float:  # linear from start to end over the run
            frac = min(1.0, step / max(1, total - 1))
            return t_cfg.noise_reveal_start + (t_cfg.noise_reveal_end - t_cfg.noise_reveal_start) * frac

        stages: list[tuple[str, Coroutine[Any, Any, Any]]] = [
            ("prefetch", prefetch.run(setup.plan, device("cpu", "data"), batches, stop, any_cuda))
        ]
        fcache = FeatureCache(cfg.data.feature_cache_mb * 2**20) if cfg.data.feature_cache_mb else None
        for i, tgt in enumerate(setup.targets):
            dev = device(str(tgt.device), f"target{i}")
            feats: Channel[TargetFeatures] = Channel(f"target{i}.features", 2)
            packed: Channel[PackedFeatures] = Channel(f"target{i}.packed", 2)
            stages += [
                (f"target_forward[{i}]", target_forward.run(tgt, dev, batches, feats, profiler, fcache)),
                (f"pack[{i}]", pack.run(dev, feats, packed)),
                (f"transfer[{i}]", transfer.run(dev, packed, hs, profiler, i, fcache)),
            ]
        for r, rep in enumerate(setup.replicas):
            stages.append(
                (
                    f"drafter_step[{r}]",
                    drafter_step.run(
                        rep, device(str(rep.device), f"drafter{r}"), hs, grads, replies[r],
                        cfg.drafter, profiler, grad_accum=cfg.train.grad_accum,
                        seed=cfg.run.seed, loss_chunk=cfg.train.loss_chunk, use_flex=use_flex,
                        noise=noise, start_step=setup.start_step,
                        **({"step_fn": synth.drafter_step(self.synthetic)} if self.synthetic else {}),
                    ),
                )
            )  # fmt: skip
        checkpointer = Checkpointer(cfg, setup.replicas[0], setup.plan, self.emit)
        opt_device = device(str(setup.replicas[0].device), "optimizer")
        opt_task = optimizer.run(
            setup.replicas, opt_device, grads, replies,
            profiler, self._emit_steps, stop, grad_clip=cfg.train.grad_clip,
            max_steps=cfg.train.max_steps, log_every=cfg.train.log_every,
            eval_every=0 if self.synthetic else cfg.eval.every_steps, evaluate=self._evaluate,
            checkpointer=None if self.synthetic else checkpointer,
            checkpoint_every=cfg.checkpoint.every_steps, checkpoint_at_end=cfg.checkpoint.at_end,
            start_step=setup.start_step, max_bad_steps=cfg.train.max_bad_steps,
            emit_bad=lambda rec: self.emit("bad_step", **rec),
            **({"apply_fn": synth.apply_step(self.synthetic)} if self.synthetic else {}),
            emit_eval=lambda rec: self.emit("eval", **rec),
        )  # fmt: skip
        stages.append(("optimizer", opt_task))

        t_train = self._t_train = time.perf_counter()
        self._start_step = setup.start_step
        prof_stop = asyncio.Event()
        prof_task = asyncio.create_task(profiler.run(prof_stop), name="profiler")
        results: dict[str, Any] = {}
        error: BaseException | None = None
        clean = False
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = {name: tg.create_task(self._guard(name, coro), name=name) for name, coro in stages}
            results = {name: t.result() for name, t in tasks.items()}
            clean = True
        except BaseExceptionGroup as eg:
            error = self._root_error(eg)
        finally:
            prof_stop.set()
            await prof_task
            profiler.emit_window(final=True)
            if trace is not None:
                try:
                    trace.write()
                except OSError as err:
                    self.emit("warning", message=f"trace not written to {trace.path}: {err.strerror or err}")
            for d in devices:  # after a failure, wait only for the optimizer's op in flight
                d.close(wait=clean or d is opt_device)
        if error is not None and isinstance(error, Exception) and (cfg.checkpoint.at_end or cfg.checkpoint.every_steps):
            # The last consistent state (weights, optimizer, cursor of the last full step).
            try:
                path = await asyncio.to_thread(checkpointer.emergency)
            except Exception as err:  # never hide the original error behind this one
                self.emit("warning", message=f"emergency checkpoint failed: {err}")
            else:
                if path is not None:
                    self.emit("checkpoint", step=checkpointer.last_step, path=str(path), emergency=True)
        if error is not None:
            if isinstance(error, Exception):
                self.emit("run_failed", error=str(error), stage=getattr(error, "stage", None))
            raise error

        train_s = time.perf_counter() - t_train
        self.steps = int(results.get("optimizer", 0))
        reason = (
            "stopped"
            if stop.is_set()
            else ("max_steps" if cfg.train.max_steps and self.steps >= cfg.train.max_steps else "data_exhausted")
        )
        if sys.stderr.isatty():
            print(file=sys.stderr)
        eval_record = None
        if cfg.eval.at_end and self.steps > 0 and not stop.is_set() and not self.synthetic:
            eval_record = await asyncio.to_thread(self._evaluate, self.steps)
            self.emit("eval", **eval_record)
        export_dir = None
        if cfg.checkpoint.export_final and self.steps > 0 and not self.synthetic:
            export_dir = self.run_dir / "final"
            await asyncio.to_thread(export_drafter, setup.replicas[0].model, export_dir)
        wall = time.perf_counter() - t_start
        self.summary = {
            "reason": reason,
            "steps": self.steps,
            "wall_s": round(wall, 3),
            "train_s": round(train_s, 3),
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / train_s, 2) if train_s > 0 else 0.0,
            "feature_cache": fcache.stats() if fcache is not None else None,
            "final_loss": self.last_step["loss"] if self.last_step else None,
            "final_tau_sim": self.last_step["tau_sim"] if self.last_step else None,
            "eval_tau": eval_record["tau"] if eval_record else None,
            "eval_lossless": eval_record["lossless"] if eval_record else None,
            "export_dir": str(export_dir) if export_dir else None,
            "run_dir": str(self.run_dir),
        }
        self.emit("run_end", **self.summary)
        return self.summary

    async def _guard(self, name: str, coro: Coroutine[Any, Any, Any]) -> Any:
        try:
            return await coro
        except (asyncio.CancelledError, StageError):
            raise
        except torch.OutOfMemoryError as e:
            hint = (
                "lower data.token_budget or data.batch_size"
                if name.startswith(("target", "prefetch"))
                else "lower drafter.max_anchors, data.token_budget or train.loss_chunk"
            )
            raise StageError(name, MemoryError(f"out of memory ({hint})")) from e
        except Exception as e:
            raise StageError(name, e) from e

    @staticmethod
    def _root_error(eg: BaseExceptionGroup) -> BaseException:
        errors = _flatten(eg)
        for e in errors:  # KeyboardInterrupt / SystemExit go through untouched
            if not isinstance(e, Exception):
                return e
        stage_errors = [e for e in errors if isinstance(e, StageError)]
        for e in stage_errors:
            if not isinstance(e.cause, ConsumerDied | ChannelClosed):
                return e
        return stage_errors[0] if stage_errors else errors[0]


def _install_signals(loop: asyncio.AbstractEventLoop, coord: Coordinator, main: asyncio.Task[Any]) -> None:
    import signal

    hits = {"n": 0}

    def on_signal(signame: str) -> None:
        hits["n"] += 1
        if hits["n"] == 1:
            print(f"\ndflash: {signame}: stopping after the current step (again to abort)", file=sys.stderr)
            coord.stop()
        else:
            main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / Windows
            pass


def run(config: Config, *, install_signals: bool = True, resume: str | Path | None = None) -> Record:
    """Run synchronously (uvloop when installed); Ctrl-C / SIGTERM stop cleanly."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    coord = Coordinator(config, resume=resume)

    async def main() -> Record:
        task = asyncio.current_task()
        assert task is not None
        if install_signals:
            _install_signals(asyncio.get_running_loop(), coord, task)
        return await coord.run()

    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            return runner.run(main())
        except asyncio.CancelledError:  # a second Ctrl-C / SIGTERM: abort now
            raise KeyboardInterrupt from None
