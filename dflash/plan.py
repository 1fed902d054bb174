"""`dflash plan CONFIG --gpus N [--gpu h200] [--nodes K] [--mfu M]`: a run's memory per device,
the best split of N devices into target chains and drafter replicas, its tokens/s and its
bottleneck — from the config and the models' configs alone (no weights are read).

The model, stage by stage, one batch of `data.token_budget` tokens (rows × row length):
- time = FLOPs (`roofline.flops`) / (MFU × the device's peak): the table's published dense
  peak for `--gpu`, or this machine's probe for `--gpu cpu`. The MFU is `--mfu` for every
  stage, or each stage's own measured in a run's profile records (`--calibrate LOG`);
- the pipeline runs at its slowest side: min(target chains / target s a batch, replicas /
  drafter s a batch); on a CPU every stage shares the one device (its time is the sum);
- the optimizer: once a step, while the replicas wait: AdamW's ~28 bytes a parameter through
  memory (the table's bandwidth, or the probe's), or the calibration run's optimizer worker
  seconds a step;
- padding: a batch's real tokens are `fill` × its budget: the calibration run's measured
  fill, else (`--fill` unset) uniform lengths within each of `data.num_buckets` equal
  buckets (packed rows: 0.97);
- memory per device: weights (bf16 target; fp32 drafter with its gradients and AdamW's two
  moments), the target's embeddings and LM head on every replica, activations at the token
  budget, the loss's logits chunk, features in flight; host: the pinned hidden-state queue.
Host work (anchors, masks, copies' launch) is the calibration run's seconds a batch per side,
else none. Not modelled: the GIL, copies between devices (their time is printed beside
the stages), the all-reduce between nodes, kernel launch gaps, data loading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dflash.config import Config
from dflash.errors import ConfigError
from dflash.roofline import flops
from dflash.roofline.peaks import GPUS, gpu_spec, probe_bandwidth, probe_peak

__all__ = ["Calibration", "plan"]

GIB = 2**30
# Published HBM bandwidth (TB/s) of the table's GPUs, for the optimizer's elementwise pass.
BANDWIDTH_TBS = {"a100": 2.04, "h100": 3.35, "h200": 4.8, "b200": 8.0, "mi300x": 5.3}
PCIE_GBS = 25.0  # a PCIe 4/5 x16 link in practice, for the features' copies
NVLINK_GBS = 300.0  # an all-to-all between the GPUs of one NVLink node, per GPU, in practice (assumed)
SP_DEGREES = (1, 2, 4, 8, 16, 32, 64)  # pipeline.sequence_parallel tried for the row length
DEFAULT_MFU = {"gpu": 0.35, "cpu": 0.1}


@dataclass(frozen=True)
class Calibration:
    """What a measured run says (`from_records`): each counted stage's MFU, the mean batch
    (rows, padded row length, real tokens: the `setup` record's `batch_shape`) and how many
    workers shared its device (a CPU's stages slow each other down: the MFU holds that)."""

    mfu: dict[str, float]
    shape: dict[str, float]
    workers: int
    host_s: dict[str, float]  # per side ("target", "drafter"): seconds a batch of its uncounted stages
    step_s: float  # the optimizer worker's seconds a step (reduce, clip, update, metrics)
    replicas: int

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> Calibration:
        from dflash.report import analyze

        a = analyze(records)
        mfu = {name: s["mfu"] for name, s in a["stages"].items() if "mfu" in s}
        if not mfu:
            msg = "--calibrate: the log has no MFU per stage (a run with profile.mfu = true writes it)"
            raise ConfigError(msg)
        setup = next((r for r in records if r.get("event") == "setup"), {})
        start = next((r for r in records if r.get("event") == "run_start"), {})
        pipe = start.get("config", {}).get("pipeline", {})
        workers = len(pipe.get("target_devices", [1])) + len(pipe.get("drafter_devices", [1]))
        from dflash.report import _group
        from dflash.runtime.profiler import Stage

        stages = a["stages"]
        batches = stages.get(Stage.DRAFTER_FORWARD, {}).get("count", 0)
        steps = stages.get(Stage.GRAD_NORM_SYNC, {}).get("count", 0)
        host_s = {"target": 0.0, "drafter": 0.0}
        step_s = 0.0
        for name, s in stages.items():
            side = _group(name)
            if side in host_s and "tflops" not in s and name not in Stage.WAITS and batches:
                host_s[side] += s["mean_ms"] / 1000 * s["count"] / batches
            elif side == "optimizer" and name not in (Stage.EVAL, Stage.CHECKPOINT) and steps:
                # A named sync on a GPU is mostly a wait for the device: its device time is the work.
                mean_ms = s.get("device_mean_ms", s["mean_ms"]) if name in Stage.HOST_SYNCS else s["mean_ms"]
                step_s += min(mean_ms, s["mean_ms"]) / 1000 * s["count"] / steps
        replicas = len(pipe.get("drafter_devices", [1]))
        return cls(mfu, setup.get("batch_shape") or {}, workers, host_s, step_s, replicas)


def _target_shape(cfg: Config) -> tuple[flops.DecoderShape, Any, str]:
    """The target's decoder shape, its transformers config and its name (no weights)."""
    if cfg.target.kind == "tiny":
        from dflash.model.target import build_tiny

        model = build_tiny(cfg.target.tiny, torch.device("meta"))
        return flops.DecoderShape.of_hf(model.config), model.config, "tiny"
    from dflash.model.loading import model_config, model_folder

    folder = model_folder(cfg.target, cfg.data.cache_dir)
    hf = model_config(folder)
    return flops.DecoderShape.of_hf(hf), hf.get_text_config(), folder.name


def _drafter_spec(cfg: Config, hf: Any, layers: int) -> Any:
    from dflash.model.drafter import default_target_layers
    from dflash.model.target import TargetInfo
    from dflash.train.build import drafter_spec

    layer_ids = cfg.target.layer_ids or default_target_layers(layers, cfg.drafter.num_layers)
    info = TargetInfo(hf, list(layer_ids), int(hf.vocab_size), "target")
    draft_vocab = cfg.drafter.draft_vocab_size
    if cfg.drafter.vocab_mapping:
        from dflash.model.vocab import DraftVocab

        draft_vocab = DraftVocab.load(cfg.drafter.vocab_mapping, int(hf.vocab_size)).size
    return drafter_spec(cfg, info, cfg.drafter.mask_token_id or 0, draft_vocab if draft_vocab < hf.vocab_size else 0)


def _bucket_fill(buckets: int, pack: bool) -> float:
    """Real tokens over padded slots with lengths uniform within equal-width buckets (each row
    padded to its bucket's longest): the mean of (i − ½)/i over the buckets."""
    if pack:
        return 0.97
    return sum((i - 0.5) / i for i in range(1, buckets + 1)) / buckets


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float
    source: str
    memory_gib: float
    bandwidth_gbs: float
    shared: bool  # one CPU: every stage on it

    def record(self, dtype: torch.dtype, count: int, nodes: int) -> dict[str, Any]:
        return {"name": self.name, "peak_tflops": self.peak_tflops, "peak_source": self.source,
                "dtype": str(dtype).removeprefix("torch."), "memory_gib": round(self.memory_gib, 1),
                "count": count, "nodes": nodes}  # fmt: skip


def _device(gpu: str, dtype: torch.dtype, cache_dir: str) -> Device:
    if gpu == "cpu":
        import psutil

        peak = probe_peak(torch.device("cpu"), dtype, cache_dir=cache_dir)
        return Device(peak.device, peak.tflops, "probe", psutil.virtual_memory().total / GIB,
                      probe_bandwidth(torch.device("cpu"), cache_dir=cache_dir), True)  # fmt: skip
    try:
        spec = gpu_spec(gpu)
    except KeyError as err:
        raise ConfigError(f"--gpu: {err.args[0]} or cpu") from None
    key = next(k for k, v in GPUS.items() if v is spec)
    return Device(spec.name, spec.tflops(str(dtype).removeprefix("torch.")), "table", spec.memory_gib,
                  BANDWIDTH_TBS[key] * 1000, False)  # fmt: skip


STAGES = ("target.model_forward", "drafter.forward", "drafter.backward")  # the stages counted in FLOPs


@dataclass(frozen=True)
class _Batch:
    """One batch: rows of the padded row length, the share of real tokens (and where it comes
    from), the anchors a row and the loss's supervised slots and LM-head rows."""

    rows: float
    length: float
    fill: float
    fill_from: str
    anchors: int
    supervised: int
    head_rows: int
    calibrated_rows: float | None  # the calibration run's mean rows: its host work scales from them

    @property
    def real(self) -> float:
        return self.rows * self.length * self.fill

    def record(self, batches_per_step: int) -> dict[str, Any]:
        return {"rows": self.rows, "row_length": self.length, "token_budget": self.rows * self.length,
                "fill": round(self.fill, 4), "fill_from": self.fill_from, "real_tokens": round(self.real),
                "anchors_per_row": self.anchors, "supervised_slots": self.supervised,
                "loss_head_rows": self.head_rows, "batches_per_step": batches_per_step}  # fmt: skip


def _length_fill(
    cfg: Config, measured: dict[str, float] | None, row_length: int | None, fill: float | None
) -> tuple[float, float, str]:
    """The padded row length (the calibration run's mean, else --row-length, else
    data.max_seq_len), the share of real tokens and where that share comes from."""
    if measured is not None and row_length is None:
        length = float(measured["row_length"])
        if fill is None:
            return length, measured["real_tokens"] / (measured["rows"] * length), "calibration run"
        return length, fill, "--fill"
    length = float(row_length or cfg.data.max_seq_len)  # --row-length may pass data.max_seq_len (long rows)
    if fill is None:
        return length, _bucket_fill(cfg.data.num_buckets, cfg.data.pack), f"{cfg.data.num_buckets} length buckets"
    return length, fill, "--fill"


def _batch(
    cfg: Config, spec: Any, calibration: Calibration | None, row_length: int | None, fill: float | None
) -> _Batch:
    """One batch: rows of the padded row length, as many as the batch size or token budget allow."""
    measured = calibration.shape if calibration is not None and calibration.shape.get("rows") else None
    length, fill, fill_from = _length_fill(cfg, measured, row_length, fill)
    rows = float(cfg.data.batch_size if not cfg.data.token_budget else max(1, cfg.data.token_budget // length))
    anchors = max(1, min(cfg.drafter.max_anchors, int(length * fill) - 1))
    head_rows = spec.draft_vocab_size or spec.vocab_size  # the drafter's head: a draft vocabulary's rows
    if cfg.loss.vocab == "data":  # the data's tokens are not known here: at most the vocabulary
        head_rows = min(spec.vocab_size, cfg.loss.negatives + spec.vocab_size // 8)
    return _Batch(rows, length, fill, fill_from, anchors, int(rows * anchors * spec.drafts), head_rows,
                  measured["rows"] if measured is not None else None)  # fmt: skip


@dataclass(frozen=True)
class _Work:
    """A batch's FLOPs on each side and the two models' parameters."""

    name: str
    target_params: float  # with the embeddings and the LM head
    drafter_params: float  # with the projection of the target's features
    layers_run: int
    teacher: bool  # the target's LM head runs for the labels or the distillation
    target: float
    drafter: Any  # `flops.drafter_step`: forward and backward

    def record(self, family: str) -> dict[str, Any]:
        return {
            "target": {"name": self.name, "params_b": round(self.target_params / 1e9, 6),
                       "layers_run": self.layers_run, "teacher_logits": self.teacher,
                       "gflop_per_batch": round(self.target / 1e9, 3)},
            "drafter": {"family": family, "params_b": round(self.drafter_params / 1e9, 6),
                        "gflop_per_batch": {"forward": round(self.drafter.forward / 1e9, 3),
                                            "backward": round(self.drafter.backward / 1e9, 3)}},
        }  # fmt: skip


def _grouped(cfg: Config, spec: Any, batch: _Batch) -> bool:
    """Whether a CPU step takes the grouped attention path (`train/build.py`'s rule)."""
    from dflash.train.build import GROUPED_ABOVE

    q = batch.anchors * spec.block_size
    auto = cfg.drafter.attention == "auto" and batch.rows * q * (batch.length + q) > GROUPED_ABOVE
    return cfg.drafter.attention == "grouped" or auto


def _work(cfg: Config, shape: flops.DecoderShape, name: str, spec: Any, batch: _Batch, on_cpu: bool) -> _Work:
    """FLOPs of the target stage and of a drafter step on `batch` (dense attention on a CPU)."""
    teacher = cfg.loss.labels == "target" or cfg.loss.distill > 0
    layer_ids = list(spec.target_layer_ids)
    f_target = flops.target_forward(shape, batch.rows, batch.length, max(layer_ids) + 1, teacher)
    dense = on_cpu and not _grouped(cfg, spec, batch)
    visible = None if dense else batch.length * batch.fill / 2 + spec.block_size  # flex / grouped: what is scored
    f_drafter = flops.drafter_step(spec, batch.rows, batch.length, batch.anchors, batch.supervised, batch.head_rows,
                                   chunk=cfg.loss.chunk, dense=dense, visible=visible)  # fmt: skip
    d_params = flops.DecoderShape.of_spec(spec).params() + len(layer_ids) * spec.hidden_size**2
    t_params = shape.params() + shape.vocab * shape.hidden * 2
    return _Work(name, t_params, d_params, max(layer_ids) + 1, teacher, f_target, f_drafter)


def _fitted_mfu(f_target: float, target_s: float, peak: float) -> float:
    """The MFU that a measured target forward of `target_s` seconds a batch implies."""
    mfu = f_target / (target_s * peak)
    if not 0 < mfu <= 1:
        raise ConfigError(f"--target-s {target_s:g}: the MFU it implies ({mfu:.3g}) is not between 0 and 1")
    return mfu


def _stage_mfu(calibration: Calibration | None, mfu: float | None, on_cpu: bool) -> dict[str, float]:
    """Each counted stage's MFU: the calibration run's, else `mfu`, else the default."""
    default = mfu or DEFAULT_MFU["cpu" if on_cpu else "gpu"]
    return {s: calibration.mfu[s] if calibration is not None and s in calibration.mfu else default for s in STAGES}


def _mfu_from(calibration: Calibration | None, target_s: float | None, mfu: float | None) -> str:
    """Where the stages' MFU comes from."""
    if calibration is not None:
        return "calibration log"
    return f"fitted to a {target_s:g} s target forward" if target_s else "--mfu" if mfu else "default"


@dataclass(frozen=True)
class _Seconds:
    """Seconds a batch of each counted stage and of the features' copy, the optimizer's
    seconds a step and each side's host work a batch."""

    target: float
    forward: float
    backward: float
    optimizer: float
    copy: float
    host: dict[str, float]

    def record(self) -> dict[str, float]:
        return {"target.model_forward": round(self.target, 6), "drafter.forward": round(self.forward, 6),
                "drafter.backward": round(self.backward, 6), "optimizer a step": round(self.optimizer, 6),
                "copy": round(self.copy, 6),
                **{f"{k}_host_work": round(v, 6) for k, v in self.host.items() if v}}  # fmt: skip


def _seconds(
    cfg: Config,
    dev: Device,
    batch: _Batch,
    work: _Work,
    mfu: dict[str, float],
    calibration: Calibration | None,
    feature_bytes: float,
) -> _Seconds:
    """Each stage's seconds at its MFU of the device's peak (on a CPU, its workers' share of it)."""
    peak = dev.peak_tflops * 1e12
    host = {"target": 0.0, "drafter": 0.0}
    if calibration is not None:  # host work grows with the rows (anchors, masks, labels)
        scale = batch.rows / batch.calibrated_rows if batch.calibrated_rows is not None else 1.0
        host = {k: v * scale for k, v in calibration.host_s.items()}
    if dev.shared:  # the CPU's workers share its cores: a calibration run's MFU already holds its own sharing
        n_workers = len(cfg.pipeline.target_devices) + len(cfg.pipeline.drafter_devices)
        share = (calibration.workers if calibration is not None else 1) / n_workers
        peak *= share
        host = {k: v / share for k, v in host.items()}  # Python work slows alike
    t_opt = 28.0 * work.drafter_params / (dev.bandwidth_gbs * 1e9)  # a replica's AdamW pass through memory
    if calibration is not None and calibration.step_s:  # measured: reduce, clip, update, metrics a step
        t_opt = calibration.step_s / (calibration.replicas if dev.shared else 1)
    return _Seconds(
        work.target / (mfu["target.model_forward"] * peak),
        work.drafter.forward / (mfu["drafter.forward"] * peak),
        work.drafter.backward / (mfu["drafter.backward"] * peak),
        t_opt,
        0.0 if dev.shared else feature_bytes / (PCIE_GBS * 1e9),  # one CPU: no copies
        host,
    )


def _memory(
    cfg: Config, shape: flops.DecoderShape, spec: Any, batch: _Batch, work: _Work, on_cpu: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """Memory, GiB, of a target chain's device and of a drafter replica's, part by part."""
    rows, length, n_layers = batch.rows, batch.length, len(spec.target_layer_ids)
    target_mem = {
        "weights": work.target_params * 2 / GIB,
        "activations": rows * length * (2 * shape.hidden + 2 * shape.intermediate) * 2 / GIB
        + (rows * length**2 / GIB if cfg.data.pack else 0.0)
        + (cfg.loss.chunk * shape.vocab * 4 / GIB if work.teacher else 0.0),
        "features": 2 * rows * length * n_layers * shape.hidden * 2 / GIB,  # the batch's, and the next's
    }
    q_tokens = rows * batch.anchors * spec.block_size
    kv_width = 2 * spec.num_kv_heads * spec.head_dim
    per_layer_act = 2 * (
        q_tokens * (6 * spec.hidden_size + 3 * spec.intermediate_size)
        + (rows * length + q_tokens) * (kv_width + spec.hidden_size)
    )
    dense_attn = 2 * rows * spec.num_heads * q_tokens / rows * (length + q_tokens / rows) if on_cpu else 0.0
    if on_cpu and _grouped(cfg, spec, batch):  # one group's scores at a time (masks.GROUP_SCORES a head)
        from dflash.model.masks import GROUP_SCORES

        dense_attn = 3 * spec.num_heads * GROUP_SCORES * 4 / spec.num_layers
    drafter_mem = {
        "weights_grads_adamw": 16 * work.drafter_params / GIB,
        # the embedding and head in bf16; a draft vocabulary's rows also kept by the drafter in fp32
        "frozen_head": (shape.vocab * 2 + spec.draft_vocab_size * 4 + (spec.draft_vocab_size or shape.vocab) * 2)
        * shape.hidden / GIB,
        "activations": (spec.num_layers * (per_layer_act + dense_attn) + rows * length * spec.hidden_size * 2) / GIB,
        "loss_chunk": 3 * min(cfg.loss.chunk, batch.supervised) * batch.head_rows * 4 / GIB,
        "features": 2 * rows * length * n_layers * shape.hidden * 2 / GIB,
    }
    return target_mem, drafter_mem


def _sequence_parallel(
    cfg: Config, spec: Any, batch: _Batch, drafter_mem: dict[str, float], usable: float, on_cpu: bool
) -> dict[str, Any]:
    """A drafter replica's memory at each sequence-parallel degree N (its share of the row's
    context, blocks, features and activations, plus the keys/values it gathers for its heads),
    the smallest N that fits, and the all-to-all a rank sends per layer (forward and backward)
    with its time over NVLink."""
    length, kvh, hd, budget = batch.length, spec.num_kv_heads, spec.head_dim, cfg.data.token_budget
    shared = drafter_mem["weights_grads_adamw"] + drafter_mem["frozen_head"]
    per_n: dict[str, float] = {}
    a2a: dict[str, float] = {}
    for n in sorted({*SP_DEGREES, cfg.pipeline.sequence_parallel}):
        if spec.num_heads % n or (kvh % n and n % kvh):
            continue
        rows = max(1, n * budget // length) if budget else batch.rows  # a group's budget is N replicas'
        q_tokens = rows * batch.anchors * spec.block_size
        gathered = spec.num_layers * 2 * (rows * length + q_tokens) * 2 * max(1.0, kvh / n) * hd * 2 / GIB
        own = drafter_mem["activations"] + drafter_mem["features"] + drafter_mem["loss_chunk"]
        rank = own * rows / batch.rows / n
        per_n[str(n)] = round(shared + rank + (gathered if n > 1 else 0.0), 3)
        # a rank's q, its k and v, and the output back: (N-1)/N of each leaves it, in bf16; twice (backward)
        sent = (2 * q_tokens * spec.num_heads * hd + 2 * (rows * length + q_tokens) * max(kvh, n) * hd) / n
        a2a[str(n)] = 2 * 2 * sent * (n - 1) / n
    fits = next((int(n) for n, gib in per_n.items() if gib <= usable), None)
    return {
        "memory_per_rank_gib": per_n,
        "degree_needed": fits,
        "all_to_all_mb_per_layer": {n: round(b / 1e6, 3) for n, b in a2a.items() if n != "1"},
        "all_to_all_ms_per_layer": None if on_cpu else {
            n: round(b / (NVLINK_GBS * 1e9) * 1e3, 4) for n, b in a2a.items() if n != "1"},
        "features_per_row_gib": round(length * len(spec.target_layer_ids) * spec.hidden_size * 2 / GIB, 4),
    }  # fmt: skip


def _splits(
    cfg: Config, dev: Device, gpus: int, sec: _Seconds, real: float, nodes: int
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None]:
    """Each split of the devices into target chains and drafter replicas (on a CPU: the
    config's) with its pace, then the best and the config's own."""
    batches_per_step = cfg.train.fresh_grad_accum
    splits = []
    pairs = [(len(cfg.pipeline.target_devices), len(cfg.pipeline.drafter_devices))] if dev.shared else [
        (n_t, gpus - n_t) for n_t in range(1, gpus)]  # fmt: skip
    for n_t, n_d in pairs:  # the slowest side sets the pace; the replicas wait for each step's update
        t_side = (max(sec.target, sec.copy) + sec.host["target"]) / n_t
        update = sec.optimizer * (n_d if dev.shared else 1)  # on one CPU the replicas' updates take turns
        d_batch = max(sec.forward + sec.backward, sec.copy) + sec.host["drafter"]
        d_side = (batches_per_step * d_batch + update) / (n_d * batches_per_step)
        splits.append({"target": n_t, "drafter": n_d, "batches_per_s": 1 / max(t_side, d_side),
                       "bottleneck": "target" if t_side >= d_side else "drafter"})  # fmt: skip
    for s in splits:
        s["tokens_per_s"] = round(s["batches_per_s"] * real * nodes, 1)
        s["batches_per_s"] = round(s["batches_per_s"] * nodes, 4)
    best = max(splits, key=lambda s: s["tokens_per_s"])
    now = {"target": len(cfg.pipeline.target_devices), "drafter": len(cfg.pipeline.drafter_devices)}
    current = next((s for s in splits if s["target"] == now["target"] and s["drafter"] == now["drafter"]), None)
    return splits, best, current


def _best_devices(
    dev: Device, best: dict[str, Any], target_mem: dict[str, float], drafter_mem: dict[str, float]
) -> list[dict[str, Any]]:
    """Each device of the best split with its role and memory (one CPU: every stage's)."""
    if dev.shared:
        return [{"device": "cpu", "role": "target+drafter",
                 "memory_gib": round(sum(target_mem.values()) + sum(drafter_mem.values()), 3)}]  # fmt: skip
    devices = []
    for i in range(best["target"] + best["drafter"]):
        role, mem = ("target", target_mem) if i < best["target"] else ("drafter", drafter_mem)
        devices.append({"device": f"gpu{i}", "role": role, "memory_gib": round(sum(mem.values()), 3)})
    return devices


def _advice(
    dev: Device, target_params: float, fits_target: bool, fits_drafter: bool, sp_needed: int | None = None
) -> str | None:
    """What to change when a side does not fit its device."""
    if not fits_target:
        need = target_params * 2 / GIB / (0.8 * dev.memory_gib)
        tp = 2 ** math.ceil(math.log2(max(need, 1.0)))
        return (
            f"the target's weights ({target_params * 2 / GIB:.0f} GiB) and activations do not fit one {dev.name} "
            f"({dev.memory_gib:.0f} GiB): serve it with target.engine = 'vllm' (or 'remote' with "
            f"`dflash serve-target`) and target.engine_tensor_parallel = {tp}, target.load = 'head'"
        )
    if not fits_drafter and sp_needed:
        return (
            f"a drafter replica does not fit a row: pipeline.sequence_parallel = {sp_needed} (a group of "
            f"{sp_needed} replicas a row; CPU replicas for now), or lower data.token_budget, "
            "drafter.max_anchors or loss.chunk"
        )
    if not fits_drafter:
        return "a drafter replica does not fit: lower data.token_budget, drafter.max_anchors or loss.chunk"
    return None


def plan(
    cfg: Config,
    gpus: int | None = None,
    gpu: str = "h100",
    nodes: int = 1,
    mfu: float | None = None,
    fill: float | None = None,
    row_length: int | None = None,
    calibration: Calibration | None = None,
    target_s: float | None = None,
) -> dict[str, Any]:
    """The plan as one JSON-ready object (`dflash plan --json` prints it). `target_s`: a
    measured target forward (seconds a batch) that fixes the MFU of every stage."""
    shape, hf, name = _target_shape(cfg)
    spec = _drafter_spec(cfg, hf, shape.layers)
    on_cpu = gpu == "cpu"
    dtype = torch.float32 if on_cpu and cfg.target.dtype in ("float32", "fastest", "auto") else torch.bfloat16
    dev = _device(gpu, dtype, cfg.data.cache_dir)
    if gpus is None:
        gpus = len(cfg.pipeline.target_devices) + len(cfg.pipeline.drafter_devices)
    if gpus < 2 and not dev.shared:
        raise ConfigError("--gpus: at least 2 (one target chain and one drafter replica)")
    batch = _batch(cfg, spec, calibration, row_length, fill)
    work = _work(cfg, shape, name, spec, batch, on_cpu)
    fitted = mfu if target_s is None else _fitted_mfu(work.target, target_s, dev.peak_tflops * 1e12)
    stage_mfu = _stage_mfu(calibration, fitted, on_cpu)
    feature_bytes = batch.real * len(spec.target_layer_ids) * spec.hidden_size * 2
    sec = _seconds(cfg, dev, batch, work, stage_mfu, calibration, feature_bytes)
    target_mem, drafter_mem = _memory(cfg, shape, spec, batch, work, on_cpu)
    splits, best, current = _splits(cfg, dev, gpus, sec, batch.real, nodes)
    usable = dev.memory_gib - (0 if dev.shared else 2.0)  # a CUDA context and the allocator's slack
    sp = _sequence_parallel(cfg, spec, batch, drafter_mem, usable, on_cpu)  # a replica's memory at each N
    fits_target = sum(target_mem.values()) <= usable
    fits_drafter = sp["memory_per_rank_gib"].get(str(cfg.pipeline.sequence_parallel), math.inf) <= usable
    batches_per_step = cfg.train.fresh_grad_accum
    out: dict[str, Any] = {
        **work.record(spec.family),
        "batch": batch.record(batches_per_step),
        "device": dev.record(dtype, gpus, nodes),
        "mfu": {s: round(v, 4) for s, v in stage_mfu.items()},
        "mfu_from": _mfu_from(calibration, target_s, mfu),
        "seconds_per_batch": sec.record(),
        "splits": splits,
        "best": best,
        "current": current,
        "tokens_per_s": best["tokens_per_s"],
        "bottleneck": best["bottleneck"],
        "step_s": round(best["drafter"] * batches_per_step / best["batches_per_s"] * nodes, 6),
        "memory_gib": {"target": {k: round(v, 3) for k, v in target_mem.items()},
                       "drafter": {k: round(v, 3) for k, v in drafter_mem.items()},
                       "host_pinned": round(cfg.pipeline.hs_queue_depth * feature_bytes / GIB, 3)},
        "devices": _best_devices(dev, best, target_mem, drafter_mem),
        "sequence_parallel": sp,
        "fits": fits_target and fits_drafter,
        "not_modelled": ["host work without --calibrate", "the GIL", "the all-reduce between nodes",
                         "kernel launch gaps", "data loading", "copies overlapping compute (shown, not added)"],
    }  # fmt: skip
    if (advice := _advice(dev, work.target_params, fits_target, fits_drafter, sp["degree_needed"])) is not None:
        out["advice"] = advice
    return out


def _params(billions: float) -> str:
    return f"{billions:.3g} B" if billions >= 1 else f"{1000 * billions:.3g} M"


def format_plan(p: dict[str, Any]) -> str:
    """The plan for people."""
    d, b, t, dr = p["device"], p["batch"], p["target"], p["drafter"]
    src = "measured here by a matmul probe" if d["peak_source"] == "probe" else "published dense peak"
    lines = [
        f"device: {d['count']} × {d['name']} per node × {d['nodes']} node(s), {d['peak_tflops']:g} TFLOP/s "
        f"{d['dtype']} ({src}), {d['memory_gib']:.0f} GiB",
        f"batch: {b['rows']:g} rows × {b['row_length']:g} tokens, {100 * b['fill']:.0f}% real ({b['fill_from']}), "
        f"{b['anchors_per_row']} anchors a row, {b['supervised_slots']} supervised slots × {b['loss_head_rows']} "
        "LM-head rows",
        f"target {t['name']} ({_params(t['params_b'])} params, {t['layers_run']} layers run"
        + (", LM head for the teacher" if t["teacher_logits"] else "")
        + f"): {t['gflop_per_batch']:,.1f} GFLOP a batch",
        f"drafter {dr['family']} ({_params(dr['params_b'])} params): forward {dr['gflop_per_batch']['forward']:,.1f} + "
        f"backward {dr['gflop_per_batch']['backward']:,.1f} GFLOP a batch",
        "MFU (" + p["mfu_from"] + "): " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in p["mfu"].items()),
        "seconds a batch: " + ", ".join(f"{k} {v:.4g}" for k, v in p["seconds_per_batch"].items()),
        "",
        f"{'split':>8} {'batches/s':>10} {'tokens/s':>12}  bottleneck",
    ]  # fmt: skip
    for s in p["splits"]:
        mark = "  <- best" if s is p["best"] or s == p["best"] else ""
        lines.append(f"{s['target']:>3} + {s['drafter']:<3} {s['batches_per_s']:>10.4g} {s['tokens_per_s']:>12,.0f}  "
                     f"{s['bottleneck']}{mark}")  # fmt: skip
    mem = p["memory_gib"]
    lines += [
        "",
        "memory per device (GiB): target " + ", ".join(f"{k} {v:.2f}" for k, v in mem["target"].items())
        + "; drafter " + ", ".join(f"{k} {v:.2f}" for k, v in mem["drafter"].items())
        + f"; host pinned {mem['host_pinned']:.2f}",
        f"fits: {'yes' if p['fits'] else 'no'}" + (f" — {p['advice']}" if p.get("advice") else ""),
        _format_sp(p["sequence_parallel"]),
        *([f"the config's split {c['target']} + {c['drafter']}: {c['tokens_per_s']:,.0f} tokens/s, bottleneck "
           f"{c['bottleneck']}"] if (c := p.get("current")) and c != p["best"] else []),
        f"predicted: {p['tokens_per_s']:,.0f} tokens/s, bottleneck {p['bottleneck']}"
        + (f", {p['step_s']:.4g} s a step" if p.get("step_s") else ""),
        "not modelled: " + "; ".join(p["not_modelled"]),
    ]  # fmt: skip
    return "\n".join(lines)


def _format_sp(sp: dict[str, Any]) -> str:
    need = sp["degree_needed"]
    head = f"sequence parallel N = {need} fits a row" if need else "sequence parallel: no N up to 64 fits a row"
    at = str(max(2, need or 2))  # the all-to-all of the degree needed, or of the first one that has it
    if at not in sp["all_to_all_mb_per_layer"]:
        return f"{head} (the drafter's heads do not split further)"
    cost = f"{sp['all_to_all_mb_per_layer'][at]:,.1f} MB a rank a layer at N={at}"
    if sp["all_to_all_ms_per_layer"] is not None:
        cost += f" (~{sp['all_to_all_ms_per_layer'][at]:.3g} ms over NVLink, forward and backward)"
    mem = ", ".join(f"N={n} {g:.1f}" for n, g in sp["memory_per_rank_gib"].items())
    return f"{head}; all-to-all {cost}; GiB a rank: {mem}; features {sp['features_per_row_gib']:.2f} GiB a row"
