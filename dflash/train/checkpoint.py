"""Checkpoints: atomic, complete, resumable.

A checkpoint is a folder `<run>/checkpoints/step_000123/` with
- `drafter.safetensors`   the drafter weights (fp32; every replica is identical),
- `optimizer.safetensors` AdamW state tensors, `state.<param index>.<name>`,
- `state.json`            step, data cursor, global batch per step (processes × replicas ×
                          grad_accum), LR schedule, optimizer param groups, drafter spec,
- `config.toml`           the resolved config of the run that wrote it.
It is written into a hidden temporary folder, every file fsynced, then renamed into place
(and the parent fsynced): a kill at any moment leaves either the old set of checkpoints or
the old set plus the complete new one. Older ones beyond `keep_last` are removed only after
that. Nothing here unpickles anything: tensors are safetensors, the rest JSON / TOML.

Resume on another number of processes: the data cursor is global (the next batch index of
the run's fixed order) and every random draw of a step is seeded by (run seed, batch index,
epoch), so W' processes continue where W stopped with rank r taking the indices ≡ r (mod W');
`train.grad_accum` is then chosen so that the global batch per step stays the checkpoint's
(`resume_grad_accum`): the steps are the same computation, up to the order of float sums.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import tomllib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash.config import Config, dump_toml, moved_keys_mapped
from dflash.errors import CheckpointError
from dflash.store.atomic import atomic_path
from dflash.train.schedule import GlobalBatch

__all__ = [
    "Checkpointer",
    "ResumeFrom",
    "Snapshot",
    "check_resume_config",
    "latest_checkpoint",
    "load_checkpoint",
    "restore",
    "resume_grad_accum",
    "snapshot",
    "write_checkpoint",
]

_STEP_RE = re.compile(r"^step_(\d{6,})$")


@dataclass
class Snapshot:
    """Host copies of everything a checkpoint holds, taken between two optimizer steps."""

    step: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    state: dict[str, Any]
    config_toml: str


def snapshot(
    step: int,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    cursor: Any,
    cfg: Config,
    world: Any = None,
    batch: GlobalBatch | None = None,
) -> Snapshot:
    """Copies to the host (fast for a drafter); the slow write happens elsewhere. `world`:
    the run's ranks and each one's data cursor (the highest batch index it consumed);
    `batch`: what one step takes over the whole run."""
    weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in opt["state"].items():
        for name, val in st.items():
            t = val if isinstance(val, torch.Tensor) else torch.tensor(val)
            tensors[f"state.{idx}.{name}"] = t.detach().to("cpu", copy=True).contiguous()
    state = {
        "step": step,
        "cursor": cursor,
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "param_groups": opt["param_groups"],
        "spec": model.spec.to_dict(),
        "world": {"size": world.size if world else 1, "cursors": list(world.cursors) if world else None},
        "batch": asdict(batch) if batch is not None else None,
        "seed": cfg.run.seed,
    }
    return Snapshot(step, weights, tensors, state, dump_toml(cfg))


def write_checkpoint(snap: Snapshot, root: Path, keep_last: int) -> Path:
    """Write atomically under `root`; returns the folder. Raises CheckpointError (disk full...)."""
    final = root / f"step_{snap.step:06d}"
    files = contextlib.ExitStack()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = files.enter_context(atomic_path(final, folder=True))
    except OSError as err:
        msg = f"cannot write checkpoints under {root}: {err.strerror or err}"
        raise CheckpointError(msg) from None
    try:
        with files:  # on leaving: fsync, rename onto `final` (the same step written again replaces it)
            save_file(snap.weights, str(tmp / "drafter.safetensors"), metadata={"format": "pt"})
            save_file(snap.optimizer, str(tmp / "optimizer.safetensors"), metadata={"format": "pt"})
            (tmp / "state.json").write_text(json.dumps(snap.state, indent=1) + "\n")
            (tmp / "config.toml").write_text(snap.config_toml)
    except (OSError, SafetensorError) as err:
        why = getattr(err, "strerror", None) or " ".join(str(err).split())
        msg = f"checkpoint at step {snap.step} not written under {root} ({why}); earlier checkpoints are intact"
        raise CheckpointError(msg) from None
    for old in _complete(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first (temporary folders are never listed)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))  # type: ignore[union-attr]


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = _complete(run_dir / "checkpoints")
    return done[-1] if done else None


@dataclass
class Loaded:
    path: Path
    step: int
    cursor: Any
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    config: dict[str, Any]
    world_size: int = 1  # processes of the run that wrote it
    batch: GlobalBatch | None = None  # what one of its steps took


def _saved_batch(state: dict[str, Any], config: dict[str, Any], world_size: int, path: Path) -> GlobalBatch:
    """The global batch of the run that wrote a checkpoint (older ones: from its config)."""
    if state.get("batch"):
        b = state["batch"]
        keys = ("processes", "replicas", "grad_accum")
        if not isinstance(b, dict) or set(b) != set(keys) or not all(type(b[k]) is int and b[k] >= 1 for k in keys):
            msg = f"{path}: unreadable checkpoint: state.json's batch {b!r} is not {', '.join(keys)} as integers >= 1"
            raise CheckpointError(msg)
        return GlobalBatch(**b)
    accum = config.get("train", {}).get("grad_accum", 1)
    replicas = len(config.get("pipeline", {}).get("drafter_devices", ["cpu"]))
    return GlobalBatch(world_size, replicas, accum if isinstance(accum, int) else 1)


def load_checkpoint(path: Path) -> Loaded:
    if not path.is_dir():
        msg = f"checkpoint not found: {path} is not a folder"
        raise CheckpointError(msg)
    files = ["drafter.safetensors", "optimizer.safetensors", "state.json", "config.toml"]
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        msg = f"{path}: not a complete dflash checkpoint (missing {', '.join(missing)})"
        raise CheckpointError(msg)
    try:
        state = json.loads((path / "state.json").read_text())
        config = moved_keys_mapped(tomllib.loads((path / "config.toml").read_text()))  # older: train.lr, ...
        weights = load_file(str(path / "drafter.safetensors"))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError, SafetensorError, OSError) as err:
        msg = f"{path}: unreadable checkpoint: {' '.join(str(err).split())}"
        raise CheckpointError(msg) from None
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in opt_tensors.items():
        _, idx, name = key.split(".", 2)
        opt_state.setdefault(int(idx), {})[name] = t
    return Loaded(
        path=path,
        step=int(state["step"]),
        cursor=state["cursor"],
        weights=weights,
        optimizer={"state": opt_state, "param_groups": state["param_groups"]},
        scheduler=state["scheduler"],
        config=config,
        world_size=int((state.get("world") or {}).get("size", 1)),
        batch=_saved_batch(state, config, int((state.get("world") or {}).get("size", 1)), path),
    )


# What must match to resume: everything that fixes the drafter's shape, what it reads, and the data.
_MUST_MATCH = [
    ("target", "kind"), ("target", "path"), ("target", "layer_ids"), ("target", "tiny"),
    ("drafter", "num_layers"), ("drafter", "block_size"), ("drafter", "layer_types"),
    ("drafter", "mask_token_id"), ("drafter", "intermediate_size"), ("drafter", "sliding_window"),
    ("data", "source"), ("data", "files"), ("data", "num_samples"), ("data", "batch_size"),
    ("data", "num_buckets"), ("data", "pack"), ("data", "max_seq_len"), ("run", "seed"),
]  # fmt: skip
# `data.token_budget` is a replica's; a sequence-parallel group's batches are cut to N times it,
# so what must match is that product (a resume at another N scales the budget to keep it).


def _group_budget(config: dict[str, Any]) -> tuple[int, int]:
    """`data.token_budget` and `pipeline.sequence_parallel` of a dumped config (defaults 0 and 1)."""
    data, pipeline = config.get("data", {}), config.get("pipeline", {})
    return int(data.get("token_budget", 0)), int(pipeline.get("sequence_parallel", 1))


def check_resume_config(saved: dict[str, Any], cfg: Config, path: Path) -> None:
    """What fixes the drafter's shape, what it reads and the data order must match. The
    number of processes and replicas may change: `resume_grad_accum` keeps the global batch."""
    now = cfg.model_dump(mode="json", exclude_none=True)
    diffs = []
    for section, key in _MUST_MATCH:
        a, b = saved.get(section, {}).get(key), now.get(section, {}).get(key)
        if a != b:
            diffs.append(f"{section}.{key} {a!r} -> {b!r}")
    (was, n_was), (budget, n) = _group_budget(saved), _group_budget(now)
    if was * n_was != budget * n and n_was == n == 1:
        diffs.append(f"data.token_budget {was!r} -> {budget!r}")
    elif was * n_was != budget * n:
        keep = f"; data.token_budget = {was * n_was // n} keeps it" if was * n_was % n == 0 else ""
        diffs.append(
            f"a group's token budget (data.token_budget × pipeline.sequence_parallel) {was} × {n_was} -> {budget} × {n}"
            + keep
        )
    if diffs:
        msg = f"{path} was written by an incompatible config: " + "; ".join(diffs[:4])
        raise CheckpointError(msg)


@dataclass(frozen=True)
class ResumeFrom:
    """What `--resume` asks: a checkpoint folder or "auto" (the newest complete one in the
    run folder; none there: a fresh start), and whether the global batch per step may change
    (`--new-global-batch`)."""

    where: str | Path
    new_global_batch: bool = False


def resume_grad_accum(loaded: Loaded, cfg: Config, processes: int, new_global_batch: bool = False) -> int:
    """`train.grad_accum` for a run resumed from `loaded` on `processes` processes: the one
    that keeps the checkpoint's global batch per step. A value that cannot keep it is
    refused in one line naming the values that would, unless `new_global_batch`."""
    # a sequence-parallel group trains one batch: it counts as one replica
    want, replicas = cfg.train.grad_accum, len(cfg.pipeline.drafter_devices) // cfg.pipeline.sp_in_process
    saved = loaded.batch or GlobalBatch()
    per = processes * replicas
    if new_global_batch:
        return want if want != "auto" else max(1, round(saved.per_step / per))
    if saved.per_step % per:
        g = saved.per_step
        divisors = [d for d in range(1, math.isqrt(g) + 1) if g % d == 0]
        divisors = sorted({*divisors, *(g // d for d in divisors)})
        pairs = [(p, r) for r in divisors for p in divisors if g % (p * r) == 0]
        pairs.sort(key=lambda pr: (pr[1] != replicas, pr[1], pr[0]))  # this run's replica count first
        msg = (
            f"{loaded.path}: its steps took {saved}; {processes} process{'es' if processes != 1 else ''} × "
            f"{replicas} replica{'s' if replicas != 1 else ''} cannot divide them: processes × replicas per "
            f"process must divide {g} ({', '.join(f'{p} × {r}' for p, r in pairs[:6])} would), "
            "or pass --new-global-batch to train with another global batch"
        )
        raise CheckpointError(msg)
    need = saved.per_step // per
    if want not in ("auto", need):
        msg = (
            f"train.grad_accum = {want} gives {GlobalBatch(processes, replicas, want)}, but the steps of "
            f'{loaded.path} took {saved.per_step}: set train.grad_accum = {need} (or "auto"), '
            "or pass --new-global-batch to train with another global batch"
        )
        raise CheckpointError(msg)
    return need


class Checkpointer:
    """A step hook: snapshots between optimizer steps, written off the hot path.

    After every `checkpoint.every_steps` steps, after the first step that ends
    `checkpoint.every_minutes` after the last checkpoint (`after_step`), and at the end of training
    with `checkpoint.at_end` (`at_end`), it takes a snapshot in the optimizer's worker
    thread (host copies only, cheap for a drafter); a writer thread then writes it while
    the pipeline goes on. One write at a time: the next snapshot (and `finish`) waits for
    the previous write first. After a crash, `emergency(progress)` writes the last
    consistent state.
    """

    def __init__(
        self,
        cfg: Config,
        replica: Any,
        plan: Any,
        emit: Any,
        start_step: int = 0,
        world: Any = None,
        batch: GlobalBatch | None = None,
    ) -> None:
        import time

        self.cfg = cfg
        self.batch = batch
        self._clock = time.monotonic
        self._since = self._clock()  # when the last checkpoint was taken (or training began)
        self.world = world
        self.writer = world is None or world.is_writer  # with several ranks, rank 0 writes
        self.replica = replica
        self.plan = plan
        self.emit = emit
        self.start_step = start_step
        self.root = cfg.run_dir / "checkpoints"
        self._pending: Any = None
        self.last_step = -1  # last step written

    async def after_step(self, ctx: Any) -> None:
        every, minutes = self.cfg.checkpoint.every_steps, self.cfg.checkpoint.every_minutes
        due = minutes > 0 and self._clock() - self._since >= 60.0 * minutes  # the writer's own clock
        if (every and ctx.step % every == 0) or due:
            await self._save(ctx)

    async def at_end(self, ctx: Any) -> None:
        if self.cfg.checkpoint.at_end and ctx.step > self.start_step and self.last_step != ctx.step:
            await self._save(ctx)
        await self.finish()

    async def _save(self, ctx: Any) -> None:
        from dflash.runtime.profiler import Stage

        if not self.writer:
            return
        self._since = self._clock()
        snap = await ctx.read(Stage.CHECKPOINT, self.take, ctx.step, ctx.last_batch, ctx.ahead)
        await self.write(snap)

    def emergency(self, progress: Any) -> Path | None:
        """After a crash, once the optimizer's worker has stopped (no update in flight): write
        the state after the last finished step (applied or skipped), unless an update was in
        progress (weights and optimizer state may disagree then: nothing is written) or it is
        written already."""
        if not self.writer or progress.updating or progress.step <= max(self.last_step, self.start_step):
            return None
        if self.replica.device.type == "cuda":  # sync point: the last update's kernels must be done
            torch.cuda.synchronize(self.replica.device)
        snap = self.take(progress.step, progress.last_batch, progress.ahead)
        path = write_checkpoint(snap, self.root, self.cfg.checkpoint.keep_last)
        self.last_step = snap.step
        return path

    def take(self, step: int, last_batch: int, ahead: Iterable[int] = ()) -> Snapshot:
        """The state after `step`; its data cursor: every batch up to `last_batch` and those
        in `ahead` are done (a resume serves the rest, each once)."""
        cursor = self.plan.cursor_after(last_batch, ahead) if last_batch >= 0 or ahead else None
        r = self.replica
        return snapshot(step, r.model, r.optimizer, r.scheduler, cursor, self.cfg, self.world, self.batch)

    async def write(self, snap: Snapshot) -> None:
        import asyncio
        import time

        await self.finish()
        self.last_step = snap.step

        async def go() -> None:
            t0 = time.perf_counter()
            path = await asyncio.to_thread(write_checkpoint, snap, self.root, self.cfg.checkpoint.keep_last)
            self.emit("checkpoint", step=snap.step, path=str(path), write_s=round(time.perf_counter() - t0, 3))

        self._pending = asyncio.ensure_future(go())

    async def finish(self) -> None:
        """Wait for the write in flight; its error (e.g. disk full) is raised here."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending


def write_run_gguf(cfg: Config, model: torch.nn.Module, out: Path) -> None:
    """The run's drafter as GGUF for llama.cpp at `out` (`checkpoint.export_gguf`), beside the
    vocabulary of the config's target (an `hf` target's converted once by llama.cpp's converter)."""
    from dflash.model.export_gguf import read_target_gguf, write_gguf
    from dflash.serving import llamacpp

    assert cfg.target.path is not None  # the config refuses the tiny target
    vocab = llamacpp.target_vocab(cfg.target.kind, cfg.target.path, cfg.data.cache_dir)
    target = read_target_gguf(vocab, cfg.target.path)
    write_gguf(model.spec, model.state_dict(), target, out, cfg.checkpoint.export_gguf)


def restore(loaded: Loaded, replicas: list[Any], cfg: Config | None = None) -> None:
    """Load a checkpoint's weights, optimizer and schedule into every replica. With this run's
    `cfg`, a drafter made for another target or shape is first refused in one line naming both
    shapes and the config keys that differ (`check_checkpoint_fits`)."""
    from dflash.eval.fit import check_checkpoint_fits
    from dflash.model.export import weight_mismatches

    if cfg is not None and replicas:
        check_checkpoint_fits(loaded.path, replicas[0].model.spec, loaded.config, cfg)
    for r in replicas:
        wrong = weight_mismatches(r.model, loaded.weights)
        if wrong:
            msg = f"{loaded.path}: drafter weights do not fit this config: {'; '.join(wrong)}"
            raise CheckpointError(msg)
        r.model.load_state_dict({k: v.to(r.device) for k, v in loaded.weights.items()})
        # The kernel choice (fused on a CPU, multi-tensor on CUDA) is this run's, not the
        # checkpoint's: a run resumed on another device kind, or from an older checkpoint,
        # is configured like a fresh one.
        impl = ("foreach", "fused", "capturable", "differentiable")
        own = r.optimizer.param_groups
        groups = [
            {**g, **({k: own[i][k] for k in impl if k in own[i]} if i < len(own) else {})}
            for i, g in enumerate(loaded.optimizer["param_groups"])
        ]
        # each replica its own moments: load_state_dict keeps a tensor already on the right device
        # as it is, and replicas on one device would otherwise step the same moments twice
        state = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
                 for k, v in loaded.optimizer["state"].items()}  # fmt: skip
        r.optimizer.load_state_dict({"state": state, "param_groups": groups})
        r.scheduler.load_state_dict({**loaded.scheduler, "lr_lambdas": [None] * len(r.optimizer.param_groups)})
