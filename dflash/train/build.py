"""Set-up: a config becomes everything a run trains with (`Training`), before the first step.

Runs in a worker thread (loading models must not block the event loop). In order: devices,
the resume checkpoint (a bad one fails in a second, before any model loads), data files,
tokenizer and targets, the mask token, the samples and their `BatchPlan`, the drafter
spec and replicas (restored when resuming), and what the end of the run will need (the
eval prompts) — so that a run never trains for an hour to fail at its end. Warnings found
on the way are kept and emitted as records by the coordinator. The loss's settings become
one `LossSpec` here, the step's limits one `StepPlan`: the step's math reads no config.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.config import Config
from dflash.data.batching import BatchPlan, Sample
from dflash.data.formats import dataset_path
from dflash.errors import CheckpointError, ConfigError, DataError
from dflash.eval.fit import check_checkpoint_target
from dflash.eval.prompts import require_eval_prompts
from dflash.features.cache import FeatureCache
from dflash.features.files import FeatureMeta, FeatureStore, folder_for
from dflash.model.drafter import DrafterSpec, FrozenHead
from dflash.model.loading import load_tokenizer
from dflash.model.loss import LossSpec, LossVocab
from dflash.model.sequence_parallel import check_heads
from dflash.model.target import Target, TargetInfo, load_target, resolve_dtype
from dflash.model.target_head import load_target_head
from dflash.model.vocab import DraftVocab, check_same, for_run, missing
from dflash.runtime import faults
from dflash.runtime.devices import check_device
from dflash.runtime.distributed import World
from dflash.runtime.profiler import Stage
from dflash.runtime.sequence import ThreadGroup, rank_groups
from dflash.store.packages import local_path
from dflash.train.checkpoint import (
    Loaded,
    ResumeFrom,
    check_resume_config,
    latest_checkpoint,
    load_checkpoint,
    restore,
    resume_grad_accum,
)
from dflash.train.hooks import StepResult
from dflash.train.replicas import DrafterReplica, build_replicas
from dflash.train.schedule import GlobalBatch, StepPlan, TimeBudget, lr_schedule
from dflash.train.step import MicroStep, apply_step

__all__ = ["SetupStopped", "Training", "build_training", "stopping_setup"]


@dataclass
class Training:
    """What a run trains with: models, data, and the two compute functions of a step."""

    targets: list[TargetInfo]  # `Target`s, or `TargetHead`s (target.load = "head")
    replicas: list[DrafterReplica]
    plan: BatchPlan
    spec: DrafterSpec
    micro: MicroStep  # one replica, one batch: forward + backward
    apply: Callable[..., StepResult]  # apply(contribs, device, step, progress): the update of every replica
    steps: StepPlan  # micro-batches per step, and what ends training (max_steps, the time budget)
    total_steps: int
    padding_fraction: float  # epoch 0's padded share of the R × T slots
    batch_shape: dict[str, float] = field(default_factory=dict)  # epoch 0's mean batch (`BatchPlan.batch_shape`)
    start_step: int = 0  # > 0 when resumed
    tokenizer: Any = None
    data_stats: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    evaluate: Callable[..., dict[str, Any]] | None = None  # evaluate(step, should_stop=None): decoding at a step
    world: World | None = None  # this process's rank among several (torchrun), else None
    cache: FeatureCache | None = None  # data.feature_cache_mb: features the target made this run
    store: FeatureStore | None = None  # the feature store beside the data files (data.feature_files)
    batch: GlobalBatch = field(default_factory=GlobalBatch)  # batches per step over the whole run
    resumed: dict[str, Any] | None = None  # what --resume found and kept or changed (the `resume` record)

    @property
    def pin(self) -> bool:
        """Pin collated batches: only worth it when some model lives on a GPU."""
        return any(m.device.type == "cuda" for m in [*self.targets, *self.replicas])


class SetupStopped(Exception):
    """Set-up saw a stop (Ctrl-C / SIGTERM) at one of its phase boundaries and ended there."""


# Whether a stop was asked, as set-up sees it (`stopping_setup`). A context variable: it reaches
# the worker thread set-up runs in (asyncio.to_thread copies the context) and the loaders below
# without a parameter through each of them.
_stop_asked: ContextVar[Callable[[], bool] | None] = ContextVar("dflash_setup_stop", default=None)


@contextlib.contextmanager
def stopping_setup(asked: Callable[[], bool]) -> Iterator[None]:
    """Within the block, set-up ends with `SetupStopped` at its next phase boundary (after the
    targets load, after the samples, before the eval's models) once `asked()` is true."""
    token = _stop_asked.set(asked)
    try:
        yield
    finally:
        _stop_asked.reset(token)


def _phase_done() -> None:
    """A phase boundary: stop here if asked. Only between phases, so that nothing is left
    half-loaded or half-written (a phase's own files are written atomically)."""
    asked = _stop_asked.get()
    if asked is not None and asked():
        raise SetupStopped


def _resume(cfg: Config, resume: ResumeFrom | str | Path | None) -> tuple[ResumeFrom | None, Loaded | None]:
    """What was asked, and the checkpoint to resume from. "auto" with none yet is a fresh
    start (a job restarted by torchrun runs one command line before and after its first
    checkpoint)."""
    if resume is None:
        return None, None
    resume = resume if isinstance(resume, ResumeFrom) else ResumeFrom(resume)
    if str(resume.where) == "auto":
        path = latest_checkpoint(cfg.run_dir)
        if path is None:
            return resume, None
    else:
        path = Path(resume.where).expanduser()
    loaded = load_checkpoint(path)
    check_checkpoint_target(path, cfg)  # another target: its shapes named, before any model loads
    check_resume_config(loaded.config, cfg, path)
    return resume, loaded


def _global_batch(
    cfg: Config, loaded: Loaded | None, resume: ResumeFrom | None, processes: int
) -> tuple[GlobalBatch, dict[str, Any] | None]:
    """This run's batches per step, and the `resume` record: resumed on another number of
    processes or replicas, `train.grad_accum` keeps the checkpoint's global batch."""
    replicas = len(cfg.pipeline.drafter_devices) // cfg.pipeline.sp_in_process  # a group trains one batch
    if loaded is None:
        batch = GlobalBatch(processes, replicas, cfg.train.fresh_grad_accum)
        if resume is None:
            return batch, None
        where = cfg.run_dir / "checkpoints"
        return batch, {"from": None, "step": 0, "global_batch": str(batch), "note": f"no checkpoint in {where} yet"}
    new = bool(resume and resume.new_global_batch)
    batch = GlobalBatch(processes, replicas, resume_grad_accum(loaded, cfg, processes, new))
    saved = loaded.batch or GlobalBatch()
    record = {
        "from": str(loaded.path),
        "step": loaded.step,
        "cursor": (loaded.cursor or {}).get("index"),
        "global_batch": str(batch),
        "checkpoint_global_batch": str(saved),
        "global_batch_changed": batch.per_step != saved.per_step,
    }
    return batch, record


def _mask_id(cfg: Config, target: TargetInfo, head: FrozenHead, warn: Callable[[str], None]) -> int:
    mask_id = cfg.drafter.mask_token_id
    if mask_id is None:
        if cfg.target.kind != "tiny":
            msg = "drafter.mask_token_id: required for a real target (an existing, unused token id)"
            raise ConfigError(msg)
        mask_id = target.vocab_size - 1
    if mask_id >= target.vocab_size:
        msg = (
            f"drafter.mask_token_id: {mask_id} is outside the target's embedding "
            f"(vocab size {target.vocab_size}; ids 0..{target.vocab_size - 1})"
        )
        raise ConfigError(msg)
    row, mean = head.norm_of_row(mask_id), head.mean_row_norm()
    if row < 0.1 * mean:
        warn(
            f"drafter.mask_token_id {mask_id}: its embedding row is near zero "
            f"(norm {row:.3g} vs mean {mean:.3g}); the drafter cannot tell mask slots apart"
        )
    return mask_id


def _samples(
    cfg: Config, target: TargetInfo, tokenizer: Any, mask_id: int, warn: Callable[[str], None]
) -> tuple[list[Sample], dict[str, Any]]:
    if cfg.data.source != "files":
        from dflash.data.synthetic import random_samples, synthesize

        samples = (
            synthesize(cfg.data, target, cfg.run.seed, exclude_token=mask_id)
            if cfg.data.source == "synthetic"
            else random_samples(cfg.data, target.vocab_size, cfg.run.seed, exclude_token=mask_id)
        )
        stats: dict[str, Any] = {"samples": len(samples)}
    else:
        if tokenizer is None:
            msg = "data.source = 'files' needs a target with a tokenizer (target.kind = 'hf' or 'gguf')"
            raise ConfigError(msg)
        from dflash.data.tokenize import load_samples

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            samples, stats = load_samples(cfg.data, tokenizer, progress=sys.stderr.isatty())
        for w in caught:  # skipped records, an unwritable cache: warning records, not stderr noise
            warn(str(w.message))
    if not samples:
        msg = "data: no samples to train on"
        raise DataError(msg)
    uses = sum(int((s.input_ids == mask_id).sum()) for s in samples)
    if uses:
        warn(
            f"drafter.mask_token_id {mask_id} occurs {uses} times in the training data; "
            "an id the data never uses is better"
        )
    _phase_done()
    return samples, stats


def drafter_spec(cfg: Config, t0: TargetInfo, mask_id: int, draft_vocab_size: int = 0) -> DrafterSpec:
    return DrafterSpec(
        draft_vocab_size=draft_vocab_size,
        hidden_size=t0.hidden_size,
        num_layers=cfg.drafter.num_layers,
        num_heads=t0.num_heads,
        num_kv_heads=t0.num_kv_heads,
        head_dim=t0.head_dim,
        intermediate_size=cfg.drafter.intermediate_size or t0.intermediate_size,
        vocab_size=t0.vocab_size,
        rms_norm_eps=t0.rms_norm_eps,
        rope_theta=t0.rope_theta,
        rope_scaling=t0.rope_scaling,
        max_position_embeddings=t0.max_position_embeddings,
        target_layer_ids=t0.layer_ids,
        num_target_layers=t0.num_layers,
        block_size=cfg.drafter.block_size,
        mask_token_id=mask_id,
        layer_types=cfg.drafter.resolved_layer_types,
        sliding_window=cfg.drafter.sliding_window,
        sliding_causal_block=cfg.drafter.sliding_causal_block,
        **family_fields(cfg, t0),
    )


def family_fields(cfg: Config, t0: TargetInfo) -> dict[str, Any]:
    """The DrafterSpec fields of the drafter's family (none for DFlash)."""
    d = cfg.drafter
    if d.family == "dflash2":
        o = d.dflash2
        if t0.hidden_size % o.conv_group_size:
            msg = (
                f"drafter.dflash2.conv_group_size ({o.conv_group_size}) does not divide the target's hidden size "
                f"({t0.hidden_size})"
            )
            raise ConfigError(msg)
        if o.selector_top_k > t0.vocab_size:
            msg = f"drafter.dflash2.selector_top_k ({o.selector_top_k}) exceeds the vocabulary ({t0.vocab_size})"
            raise ConfigError(msg)
        return {
            "family": "dflash2", "conv_kernel_size": o.conv_kernel_size, "conv_group_size": o.conv_group_size,
            "selector_rank": o.selector_rank, "selector_top_k": o.selector_top_k,
        }  # fmt: skip
    if d.family == "dspark":
        o = d.dspark
        return {
            "family": "dspark", "markov_rank": o.markov_rank, "confidence_head": o.confidence_head,
            "confidence_with_markov": o.confidence_head and o.confidence_with_markov,
        }  # fmt: skip
    return {}


def _evaluator(cfg: Config, target: Target, replica: DrafterReplica, tokenizer: Any) -> Callable[..., dict[str, Any]]:
    """Speculative decoding with replica 0 against target 0 on the held-out prompts, which
    are loaded now: missing prompts fail the run before its first step, not after its last.
    `run(step, should_stop)`: `should_stop()` true ends it (`EvalStopped`) at its next decoding step."""
    from dflash.eval import DecodeSettings, eval_prompts, evaluate, stop_ids

    _phase_done()  # before eval_target, which may load a second target
    target = eval_target(cfg, target)
    prompts = eval_prompts(cfg, target, tokenizer, replica.model.spec.mask_token_id)
    stops = stop_ids(target, tokenizer)

    def run(step: int, should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        faults.check(Stage.EVAL)
        model, head = replica.model, replica.head
        rec = evaluate(target, model, head, prompts, DecodeSettings.of(cfg, stops, should_stop))
        return {"step": step, **rec}

    return run


def eval_target(cfg: Config, target: Target) -> Target:
    """The target eval runs: the training one, or (`eval.target_dtype` other than its dtype)
    a second copy in that dtype, loaded now from the same (cached) weights."""
    if cfg.eval.target_dtype == "same":
        return target
    dtype = resolve_dtype(cfg.eval.target_dtype, target.device)
    if dtype == target.embed_weight.dtype:
        return target
    tcfg = cfg.target.model_copy(update={"dtype": cfg.eval.target_dtype, "layer_ids": target.layer_ids})
    return load_target(tcfg, target.device, cfg.drafter.num_layers, cfg.data.cache_dir)


def _feature_store(
    cfg: Config, t0: TargetInfo, samples: list[Sample], stats: dict[str, Any], warn: list[str]
) -> FeatureStore | None:
    """The feature store beside the data files (`regen.save_features`, `dflash features`), read
    from disk by the feature read stage; None when there is none, or none that serves this run.
    Its index is memory-mapped (built first if the folder's parts changed); the samples it
    covers are counted by key, with no per-sample object kept."""
    folders = []
    if cfg.data.source == "files" and cfg.data.feature_files:
        folders = [f for f in (folder_for(local_path(d.path)) for d in cfg.data.files) if f.is_dir()]
    if not folders:
        return None
    topk = LossSpec.from_config(cfg).teacher_topk
    if topk > 1:
        warn.append(f"feature files {folders[0]} not used: loss.distill needs the target's top-k logits")
        return None
    store = FeatureStore(folders, FeatureMeta.of(t0), topk, cfg.data.max_seq_len, warn)
    stats["feature_files_entries"] = store.entries
    stats["feature_files_samples"] = store.covered(samples) if store.entries else 0
    return store if stats["feature_files_samples"] else None


def _check_shardable(world: World | None, loaded: Loaded | None) -> None:
    """Several processes (`world`) shard the batches by index and take them in order: a
    checkpoint whose batches were consumed out of order resumes in one process only."""
    if world is not None and loaded is not None and (loaded.cursor or {}).get("done"):
        msg = (
            f"checkpoint step {loaded.step}: its batches were consumed out of order (cursor {loaded.cursor['index']} "
            f"and {len(loaded.cursor['done'])} after it); resume it in one process (several processes shard the "
            "batches by index and take them in order)"
        )
        raise CheckpointError(msg)


def _check_before_models(cfg: Config) -> tuple[LossSpec, bool]:
    """What fails before any model loads (a missing data file, the held-out prompts the end of
    the run needs, what a head-only target cannot do); the loss's settings and whether the run
    evaluates."""
    _check_data_files(cfg)
    wants_eval = cfg.eval.at_end or cfg.eval.every_steps > 0
    if wants_eval:  # what the end of the run needs, before any model loads
        require_eval_prompts(cfg, also=", or set eval.at_end = false")
    loss = LossSpec.from_config(cfg)
    _check_head_only(cfg, loss, wants_eval)
    return loss, wants_eval


def _replicas(
    cfg: Config,
    spec: DrafterSpec,
    head: FrozenHead,
    t0: TargetInfo,
    devices: list[torch.device],
    lr: Callable[[float], float],
    vocab: DraftVocab | None = None,
    world: World | None = None,
) -> list[DrafterReplica]:
    """One drafter replica a device (`build_replicas`), from the target's layers with
    drafter.init_from_target; `lr`: the LR schedule; `vocab`: a draft vocabulary; in groups of
    `pipeline.sequence_parallel`."""
    init_from = t0.model if cfg.drafter.init_from_target else None
    replicas = build_replicas(spec, head, devices, cfg.optimizer, lr, cfg.run.seed, init_from, vocab)
    p = cfg.pipeline
    if p.sequence_parallel > 1:
        _check_sequence_parallel(spec, devices, p.sequence_parallel)
    if p.sp_in_process > 1:
        for g in range(0, len(replicas), p.sp_in_process):  # groups of N in the order of drafter_devices
            group = ThreadGroup(p.sp_in_process)
            for rank, rep in enumerate(replicas[g : g + p.sp_in_process]):
                rep.seq_group, rep.seq_rank = group, rank
    elif p.sp_across_ranks > 1:  # one replica a process: N consecutive torchrun ranks
        assert world is not None  # `_sequence_parallel_ranks` checked it
        replicas[0].seq_group, replicas[0].seq_rank = rank_groups(
            world.rank, world.size, p.sp_across_ranks, cfg.distributed.timeout_s)  # fmt: skip
    return replicas


def _check_sequence_parallel(spec: DrafterSpec, devices: list[torch.device], n: int) -> None:  # no-sync: set-up
    """Whether the drafter's heads split over N ranks and the group's devices are CPUs (the
    all-to-all moves host tensors)."""
    why = check_heads(spec.num_heads, spec.num_kv_heads, n)
    if why is not None:
        raise ConfigError(f"pipeline.sequence_parallel: {why}")
    if any(d.type != "cpu" for d in devices):
        msg = "pipeline.sequence_parallel: the group's all-to-all moves host tensors; CUDA drafter devices not yet"
        raise ConfigError(msg)


def _sequence_parallel_ranks(cfg: Config, world: World | None) -> int:
    """The processes that train distinct batches: the world's, over its groups of ranks."""
    p, size = cfg.pipeline, world.size if world is not None else 1
    if p.sp_across_ranks > 1 and size % p.sp_across_ranks:
        msg = (
            f"pipeline.sequence_parallel = {p.sp_across_ranks} with one drafter device: groups of that many torchrun "
            f"ranks, but {size} process{'es' if size != 1 else ''} ran (list N drafter_devices for a group in one "
            "process)"
        )
        raise ConfigError(msg)
    return size // p.sp_across_ranks


def _restore(loaded: Loaded, replicas: list[DrafterReplica], cfg: Config, vocab: DraftVocab | None) -> None:
    """The checkpoint into the replicas; its draft vocabulary must be this run's."""
    restore(loaded, replicas, cfg)
    if vocab is not None:
        check_same(replicas[0].model.d2t, vocab, loaded.path)


def _draft_vocab(
    cfg: Config, t0: TargetInfo, tokenizer: Any, samples: list[Sample], mask_id: int, stats: dict[str, Any],
    world: World | None, loaded: Loaded | None, warned: list[str],
) -> DraftVocab | None:  # fmt: skip
    """The run's draft vocabulary (`vocab.for_run`: the end-of-turn and mask tokens always in;
    resumed: the checkpoint's); its size and the share of supervised tokens it holds go in the
    data stats; a map made elsewhere that leaves out an end-of-turn token is a warning."""
    from dflash.eval.prompts import stop_ids_of

    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    ends = ({int(eos)} if eos is not None else set()) | (stop_ids_of(t0) if hasattr(t0, "model") else set())  # type: ignore[arg-type]
    resumed = loaded.weights.get("d2t") if loaded is not None else None
    vocab = for_run(cfg, t0.vocab_size, samples, [mask_id, *ends], world is None or world.is_writer, resumed)
    top_k = cfg.drafter.dflash2.selector_top_k
    if vocab is not None and cfg.drafter.family == "dflash2" and top_k > vocab.size:
        msg = f"drafter.dflash2.selector_top_k ({top_k}) exceeds the draft vocabulary's {vocab.size} tokens"
        raise ConfigError(msg)
    if vocab is not None:
        stats["draft_vocab"] = {"size": vocab.size, "coverage": round(vocab.coverage(), 4)}
        left_out = missing(vocab, ends)
        if left_out and cfg.drafter.vocab_mapping:
            warned.append(f"drafter.vocab_mapping leaves out the end-of-turn token(s) {left_out}: never drafted")
    return vocab


def build_training(cfg: Config, resume: ResumeFrom | str | Path | None = None, world: World | None = None) -> Training:
    """Build a run's `Training` from its config (in a worker thread). With a `world` (several
    processes), this rank's share: the same initial weights on every rank (same seed), the
    step count of the whole world, and evals on rank 0 only. `resume`: a `ResumeFrom` (or its `where`)."""
    torch.manual_seed(cfg.run.seed)
    t_devs, d_devs = _devices(cfg, world)
    ranks = _sequence_parallel_ranks(cfg, world)  # processes training distinct batches
    resume, loaded = _resume(cfg, resume)  # before loading any model: a bad checkpoint fails in a second
    _check_shardable(world, loaded)
    batch, resumed = _global_batch(cfg, loaded, resume, ranks)
    loss, wants_eval = _check_before_models(cfg)
    found: list[str] = list(world.warnings) if world is not None else []
    tokenizer = load_tokenizer(cfg.target, cfg.data.cache_dir)
    targets = _targets(cfg, t_devs, loss)
    with _closed_on_failure(targets):  # an engine started for them does not outlive a failed set-up
        t0 = targets[0]
        head = FrozenHead(t0.embed_weight, t0.lm_head_weight)
        mask_id = _mask_id(cfg, t0, head, found.append)
        samples, stats = _samples(cfg, t0, tokenizer, mask_id, found.append)
        store = _feature_store(cfg, t0, samples, stats, found)
        _check_all_stored(cfg, samples, stats, found)
        plan = BatchPlan.from_config(samples, cfg.data, cfg.train.epochs, cfg.run.seed,
                                     start=loaded.cursor if loaded else None, shared_by=cfg.pipeline.sequence_parallel)
        total = cfg.train.max_steps or _total_steps(plan, batch, loaded.step if loaded else 0)
        vocab = _draft_vocab(cfg, t0, tokenizer, samples, mask_id, stats, world, loaded, found)
        spec = drafter_spec(cfg, t0, mask_id, 0 if vocab is None else vocab.size)
        budget = TimeBudget(cfg.train.max_minutes) if cfg.train.max_minutes else None
        replicas = _replicas(cfg, spec, head, t0, d_devs, lr_schedule(cfg.schedule, total, budget), vocab, world)
        if loss.vocab == "data":  # the loss's softmax over the data's tokens (the mask id is never a label)
            stats["loss_vocab"] = _loss_vocab(replicas, samples, loss.negatives)
        if loaded is not None:
            _restore(loaded, replicas, cfg, vocab)
        micro = _micro_step(cfg, loss, d_devs[0], total)
        update = functools.partial(apply_step, replicas, grad_clip=cfg.optimizer.grad_clip, world=world, budget=budget)
        writer = world is None or world.is_writer
        evaluate = _evaluator(cfg, t0, replicas[0], tokenizer) if wants_eval and writer else None
        fence([*(t.device for t in targets), *(r.device for r in replicas)])  # the last set-up work is queued above
        return Training(
            targets=targets,
            replicas=replicas,
            plan=plan,
            spec=spec,
            micro=micro,
            apply=update,
            steps=StepPlan(batch.grad_accum, cfg.train.max_steps, budget),
            cache=FeatureCache.from_config(cfg.data.feature_cache_mb),
            store=store,
            total_steps=total,
            padding_fraction=plan.padding_fraction(0),  # laying out epoch 0 is work: here, not on the loop
            batch_shape=plan.batch_shape(0),
            start_step=loaded.step if loaded else 0,
            tokenizer=tokenizer,
            data_stats=stats,
            warnings=found,
            evaluate=evaluate,
            world=world,
            batch=batch,
            resumed=resumed,
        )


def _total_steps(plan: BatchPlan, batch: GlobalBatch, done: int) -> int:
    """The steps the whole data makes: those done before a resume, then the batches left at
    this run's global batch (the same count as a fresh run's unless `--new-global-batch`)."""
    return max(1, done + math.ceil((len(plan) - plan.start_index - len(plan.done_ahead)) / batch.per_step))


# `drafter.attention = "auto"` without flex: the dense mask up to this many entries (rows × block
# queries × keys) a batch, the grouped path beyond (a 16K-token row with 256 anchors of 16 is ~8e7)
GROUPED_ABOVE = 1 << 26


def _micro_step(cfg: Config, loss: LossSpec, device: torch.device, total: int) -> MicroStep:
    flex = cfg.drafter.attention == "flex" or (cfg.drafter.attention == "auto" and device.type == "cuda")
    grouped = cfg.drafter.attention == "grouped"
    above = GROUPED_ABOVE if cfg.drafter.attention == "auto" and not flex else 0  # long rows on a CPU: grouped
    return MicroStep(loss, seed=cfg.run.seed, max_anchors=cfg.drafter.max_anchors, use_flex=flex, total_steps=total,
                     grouped=grouped, grouped_above=above)  # fmt: skip


def fence(devices: Iterable[torch.device]) -> None:
    """Wait until every CUDA device among `devices` has run its queued work. Set-up queues
    work on the legacy default stream (the frozen head copied to a replica's GPU, the loss
    vocabulary's rows of the LM head, a tiny target's random weights), and the stages run on
    streams of torch's pool, which do not wait on the legacy stream: without this fence a
    stage's first kernel could read a tensor that set-up is still writing."""
    for dev in dict.fromkeys(d for d in devices if d.type == "cuda"):
        torch.cuda.synchronize(dev)  # sync: once, at the end of set-up


def _devices(cfg: Config, world: World | None) -> tuple[list[torch.device], list[torch.device]]:
    """The target and drafter devices, checked, and the settings that depend on them."""
    t_devs = [check_device(d, f"pipeline.target_devices[{i}]") for i, d in enumerate(cfg.pipeline.target_devices)]
    d_devs = [check_device(d, f"pipeline.drafter_devices[{i}]") for i, d in enumerate(cfg.pipeline.drafter_devices)]
    if cfg.drafter.attention == "flex" and any(d.type == "cpu" for d in d_devs):
        msg = (
            "drafter.attention = 'flex': flex attention has no backward on CPU in this torch; "
            "use 'auto' (flex on CUDA, dense SDPA on CPU) or 'sdpa'"
        )
        raise ConfigError(msg)
    if world is not None and cfg.train.max_minutes:
        msg = "train.max_minutes needs one process: the ranks' clocks would give them different learning rates"
        raise ConfigError(msg)
    return t_devs, d_devs


def _check_data_files(cfg: Config) -> None:
    if cfg.data.source != "files":
        return
    for i, f in enumerate(cfg.data.files):  # a missing file fails now, before any model loads
        dataset_path(f.path, f"data.files[{i}]")


@contextlib.contextmanager
def _closed_on_failure(targets: list[TargetInfo]) -> Iterator[None]:
    """The targets closed (a live vLLM engine shut down, a remote server told to stop) when
    set-up fails or is stopped after they were made; on success the coordinator closes them."""
    try:
        yield
    except BaseException:
        for tgt in targets:
            close = getattr(tgt, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()
        raise


def _targets(cfg: Config, devices: list[torch.device], loss: LossSpec) -> list[TargetInfo]:
    """One target per chain (`target.load = "head"`: its embeddings and LM head only). With
    target labels or distillation, their forwards also give their top-k next-token logits.
    An engine started for one chain is closed again when a later one, or a check, fails."""
    load = load_target_head if cfg.target.load == "head" else load_target
    loaded = [load(cfg.target, dev, cfg.drafter.num_layers, cfg.data.cache_dir) for dev in devices]
    targets: list[TargetInfo] = []
    with _closed_on_failure(targets):
        for t in loaded:
            targets.append(_with_engine(cfg, t))
            targets[-1].teacher_topk = loss.teacher_topk
        if loss.distill > 0 and targets[0].logit_transform:
            how = ", ".join(targets[0].logit_transform)
            msg = f"loss.distill: the target transforms its logits ({how}): not supported yet"
            raise ConfigError(msg)
        _phase_done()
    return targets


def _with_engine(cfg: Config, target: TargetInfo) -> TargetInfo:
    """The target as the chain runs it: its decoder layers in a live vLLM engine started now
    (`target.engine = "vllm"`), in a `dflash serve-target` elsewhere ("remote"), or its own."""
    if cfg.target.engine == "vllm":
        from dflash.targets.live import EngineTarget

        return EngineTarget(target, cfg)
    if cfg.target.engine == "remote":
        from dflash.targets.spool_client import SpoolTarget

        return SpoolTarget(target, cfg)
    return target


def _check_head_only(cfg: Config, loss: LossSpec, wants_eval: bool) -> None:
    """`target.load = "head"`: what would need the target's decoder layers is refused before
    anything loads."""
    if cfg.target.engine != "local":  # the engine serves every batch's features
        from dflash.targets.live import check_engine_target

        check_engine_target(cfg)
    if cfg.target.load != "head":
        return
    live = cfg.target.engine != "local"
    needs = [
        (cfg.data.source != "files" and not live, "data.source = 'files' (their feature files hold the features)"),
        (not cfg.data.feature_files and not live, "data.feature_files = true"),
        (wants_eval, "eval.at_end = false and eval.every_steps = 0 (then decode in vLLM: "
         "`dflash eval CONFIG --drafter RUN/final --engine vllm`)"),
        (cfg.drafter.init_from_target, "drafter.init_from_target = false"),
        (loss.teacher_topk > 1, "loss.distill = 0 (feature files hold no top-k logits)"),
    ]  # fmt: skip
    for bad, what in needs:
        if bad:
            msg = f"target.load = 'head' (no decoder layers) needs {what}"
            raise ConfigError(msg)


def _check_all_stored(cfg: Config, samples: list[Sample], stats: dict[str, Any], warned: list[str]) -> None:
    """`target.load = "head"`: every sample's features are in the feature store (else the
    error says why, with the first warning opening it gave: a part that could not serve)."""
    stored = stats.get("feature_files_samples", 0)
    if cfg.target.load == "head" and cfg.target.engine == "local" and stored < len(samples):
        why = next((w for w in warned if "feature" in w), "")
        msg = (
            f"target.load = 'head': {stored} of {len(samples)} samples have their features in the feature "
            "store beside the data files; store the rest with `dflash features CONFIG`" + (f" ({why})" if why else "")
        )
        raise DataError(msg)


def _loss_vocab(replicas: list[DrafterReplica], samples: list[Sample], negatives: int) -> int:
    """`loss.vocab = "data"`: each replica's loss head over the data's tokens (on its own
    device); how many distinct tokens that is."""
    present = torch.zeros(replicas[0].head.lm_head.shape[0], dtype=torch.bool)
    for s in samples:  # one pass, memory of the vocabulary's size, not the data's
        present[s.input_ids] = True
    tokens = present.nonzero().flatten()
    for r in replicas:
        r.loss_vocab = LossVocab.of(r.head.lm_head, tokens, negatives)
    return len(replicas[0].loss_vocab.lm_head)  # type: ignore[union-attr]  # set just above
