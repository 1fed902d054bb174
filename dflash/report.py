"""`dflash report LOG`: read a run's JSON log and say where the time went.

Drops warm-up windows, sums every stage over the remaining `profile` records, groups the
stages by the worker that runs them (data, target, drafter, optimizer — the work of one
group is serial, so its busy fraction is how loaded that worker is), and names the
bottleneck: the busiest group. Wait stages (queue waits, step waits) are idle time and
tell the rest of the story: drafters waiting on the hidden-state queue are starved by the
targets; targets waiting to put are back-pressured by the drafters. On a GPU the named host
syncs (`drafter.grad_norm_sync`, `metrics.sync`) are mostly the host waiting for the device's
queued work: their device time counts as the optimizer's work, the rest as a wait for the GPU
(one process only: with several ranks the sync also waits for the others' all-reduce).

A run of several processes (torchrun) has a `rank` in every record: the report then reads
each rank on its own as well (its throughput, busy fractions, bottleneck, the share of the
cross-node all-reduce `drafter.allreduce`) and names the slowest rank — the one whose
busiest worker has the most work per optimizer step outside the all-reduce (the all-reduce
is where the other ranks wait for it). Records without `rank`: one process.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dflash.errors import DataError
from dflash.runtime.profiler import Stage

__all__ = ["analyze", "format_report", "read_logs", "read_records"]

GPU_BOUND_WAIT = 0.25  # the host waiting for the GPU in named syncs this share of wall time, at least: GPU-bound

# Which worker runs a stage (the optimizer thread runs the drafter.grad_* / optimizer stages).
_OPTIMIZER = {Stage.GRAD_REDUCE, Stage.ALLREDUCE, Stage.GRAD_NORM_SYNC, Stage.OPTIMIZER_STEP, Stage.METRICS_SYNC,
              Stage.EVAL, Stage.CHECKPOINT}  # fmt: skip


def _group(stage: str) -> str:
    if stage in _OPTIMIZER:
        return "optimizer"
    if stage.startswith("data."):
        return "data"
    if stage.startswith("target."):
        return "target"
    return "drafter"  # drafter.* and dflash.create_block_mask


def read_records(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            msg = f"{source}:{n}: not a JSON line (pipe the stdout of `dflash run`, or its --log-file)"
            raise DataError(msg) from None
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _run_folder_logs(folder: Path) -> list[Path]:
    """A run folder's logs: rank 0's `records.jsonl`, then `records.rankN.jsonl` by N."""
    ranked = []
    for f in folder.glob("records.rank*.jsonl"):
        m = re.fullmatch(r"records\.rank(\d+)\.jsonl", f.name)
        if m:
            ranked.append((int(m[1]), f))
    first = folder / "records.jsonl"
    files = ([first] if first.is_file() else []) + [f for _, f in sorted(ranked)]
    if not files:
        msg = f"{folder}: no records.jsonl or records.rankN.jsonl in this folder (give a run folder or a log file)"
        raise DataError(msg)
    return files


def _stdin_lines() -> Iterator[str]:
    buf = getattr(sys.stdin, "buffer", None)
    if buf is None:
        yield from sys.stdin
    else:
        for raw in buf:
            yield raw.decode("utf-8")


def read_logs(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Every record of the logs named, in order: files, `-` (stdin; also when none is named),
    and run folders (their `records.jsonl` and `records.rankN.jsonl`)."""
    records: list[dict[str, Any]] = []
    for path in paths or ["-"]:
        if path == "-":
            records += read_records(_stdin_lines(), "<stdin>")
            continue
        p = Path(path)
        for f in _run_folder_logs(p) if p.is_dir() else [p]:
            name = path if f is p else str(f)
            try:
                with open(f, encoding="utf-8") as fh:
                    records += read_records(fh, name)
            except OSError as err:
                msg = f"{name}: {err.strerror}"
                raise DataError(msg) from None
    return records


def _ranks(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]] | None:
    """Records by rank, ranks in order; None when no record has a rank (one process)."""
    if not any("rank" in r for r in records):
        return None
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        rank = r.get("rank", 0)
        if isinstance(rank, bool) or not isinstance(rank, int):
            msg = f"a record's rank is {rank!r}, not an integer"
            raise DataError(msg)
        out[rank].append(r)
    return dict(sorted(out.items()))


def _steady(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The profile records, and those that count: warm-up and final windows dropped (all
    of them kept when nothing else is left)."""
    profiles = [r for r in records if r.get("event") == "profile"]
    steady = [p for p in profiles if not p.get("warmup") and not p.get("final")] or profiles
    return profiles, steady


def analyze(records: list[dict[str, Any]]) -> dict[str, Any]:
    by_rank = _ranks(records)
    if by_rank is None:
        return _analyze(records, *_steady(records))
    return _analyze_ranks(records, by_rank)


def _analyze(
    records: list[dict[str, Any]], profiles: list[dict[str, Any]], steady: list[dict[str, Any]], ranked: bool = False
) -> dict[str, Any]:
    """`ranked`: records of several processes, whose grad-norm sync also waits for the other
    ranks' all-reduce: there the named syncs stay the optimizer's time (no GPU verdict)."""
    if not profiles:
        msg = "no profile records in the log (was it written by `dflash run`?)"
        raise DataError(msg)
    wall = sum(p["wall_s"] for p in steady)
    stages = _sum_stages(steady)
    cuda = any("device_mean_ms" in s for p in steady for s in p["stages"].values())
    table, groups, waits = _stage_table(stages, wall, gpu_syncs=cuda and not ranked)
    gpu_wait = sum(v for k, v in waits.items() if k in Stage.HOST_SYNCS)  # 0 but on CUDA, one process
    per_worker = _worker_shares(steady, wall, gpu_wait)
    busiest = next(iter(per_worker), None)
    if busiest is not None and busiest != "loop":
        # The busiest worker names the bottleneck (several replicas of a role add up in
        # `groups`, but each runs on its own device).
        bottleneck: str | None = _role(busiest) or busiest
    else:
        bottleneck = max(groups, key=lambda g: groups[g]) if groups else None
    tok = [p["tokens_per_s"]["drafter"] for p in steady]
    measured = sum(tok) / len(tok) if tok else 0.0
    busy = max((v for w, v in per_worker.items() if _role(w) == bottleneck), default=0.0)
    if not busy:
        busy = groups.get(bottleneck, 0.0) if bottleneck else 0.0
    # The host waiting for the GPU longer than any worker is busy: the device's queued work is
    # the limit. The named syncs wait for the drafters' device work (on one GPU, shared with
    # the target's), so the drafter is named; no host worker's idling bounds the throughput.
    gpu_bound = gpu_wait >= GPU_BOUND_WAIT and gpu_wait >= busy
    if gpu_bound:
        bottleneck = "drafter"
    return {
        "windows": len(steady),
        "warmup_windows_dropped": len(profiles) - len(steady),
        "wall_s": round(wall, 3),
        "stages": table,
        "busy": {g: round(v, 4) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "workers": per_worker,
        "waits": {k: round(v, 4) for k, v in waits.items()},
        "bottleneck": bottleneck,
        "gpu_bound": round(gpu_wait, 4) if gpu_bound else None,  # the share of wall time the host waits for it
        "tokens_per_s": round(measured, 2),
        # If the bottleneck worker were busy all the time, throughput would scale by 1/busy.
        "bound_tokens_per_s": round(measured / busy, 2) if busy > 0 and not gpu_bound else None,
        "host_share": round(sum(groups.values()), 4),
        # On CUDA, host time is launch work holding the GIL; on CPU it includes the compute
        # itself (torch releases the GIL there), so the GIL verdict is only made on CUDA.
        "cuda": cuda,
        "what_if": _what_if(records, stages, groups),
        "roofline": _roofline(steady, table, bottleneck),
    }


def _roofline(steady: list[dict[str, Any]], table: dict[str, dict[str, Any]], bottleneck: str | None) -> Any:
    """FLOPs against the devices' peaks over the steady windows (their `roofline` records):
    each counted stage's TFLOP/s and MFU (into `table`), the stage furthest below its peak,
    and `tokens/s if every device ran at the MFU m` of the bottleneck's busiest counted stage."""
    gflop: dict[str, float] = defaultdict(float)
    busy: dict[str, float] = defaultdict(float)
    device: dict[str, str] = {}
    peaks: dict[str, dict[str, Any]] = {}
    for p in steady:
        if "roofline" not in p:
            continue
        peaks.update(p["roofline"]["peaks"])
        for name, s in p["stages"].items():
            if s.get("tflops") and s.get("gflop"):
                gflop[name] += s["gflop"]
                busy[name] += s["gflop"] / 1000 / s["tflops"]
                device[name] = s.get("device", "")
    if not gflop:
        return None
    mfu: dict[str, float] = {}
    for name, g in gflop.items():
        tflops = g / 1000 / busy[name]
        row = table.setdefault(name, {})
        row["tflops"] = round(tflops, 4)
        peak = peaks.get(device[name], {}).get("tflops")
        if peak and name not in Stage.ELEMENTWISE:
            mfu[name] = tflops / peak
            row["mfu"] = round(mfu[name], 4)
    out: dict[str, Any] = {"peaks": peaks}
    if not mfu:
        return out
    out["furthest_below"] = min(mfu, key=mfu.__getitem__)
    mine = [n for n in mfu if _group(n) == bottleneck] or list(mfu)
    ref = max(mine, key=busy.__getitem__)
    tokens = sum(p["tokens_per_s"]["drafter"] * p["wall_s"] for p in steady)
    per_device: dict[str, float] = defaultdict(float)
    for name, g in gflop.items():
        per_device[device[name]] += g * 1e9
    out |= {"mfu_of": ref, "at_mfu": round(mfu[ref], 4)}
    bounds = [mfu[ref] * peaks[d]["tflops"] * 1e12 * tokens / f for d, f in per_device.items() if d in peaks and f]
    if tokens > 0 and bounds:
        out["bound_tokens_per_s"] = round(min(bounds), 1)
    return out


def _role(worker: str) -> str:
    """A worker's role: its name without the replica number (`drafter1` -> `drafter`)."""
    return worker.rstrip("0123456789")


def _sum_stages(steady: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each stage over the windows: calls and seconds summed, the worst max and p95."""
    stages: dict[str, dict[str, float]] = defaultdict(
        lambda: {"count": 0, "total_s": 0.0, "max_ms": 0.0, "p95_ms": 0.0}
    )
    for p in steady:
        for name, s in p["stages"].items():
            st = stages[name]
            st["count"] += s["count"]
            st["total_s"] += s["total_s"]
            if "device_mean_ms" in s:  # CUDA events: the device's time of the span's work
                st["device_s"] = st.get("device_s", 0.0) + s["device_mean_ms"] * s["count"] / 1000
            st["max_ms"] = max(st["max_ms"], s["max_ms"])
            st["p95_ms"] = max(st["p95_ms"], s["p95_ms"])
    return stages


def _stage_table(
    stages: dict[str, dict[str, float]], wall: float, gpu_syncs: bool = False
) -> tuple[dict[str, dict[str, Any]], dict[str, float], dict[str, float]]:
    """The report's stage table (busiest first), and each stage's share of wall time summed
    by role (work) or kept by stage (waits: idle time). `gpu_syncs` (CUDA, one process): a
    named host sync is work for its device time only; the rest of it is kept as a wait (the
    host waiting for the GPU)."""
    table = {}
    groups: dict[str, float] = defaultdict(float)
    waits: dict[str, float] = {}
    for name, st in sorted(stages.items(), key=lambda kv: -kv[1]["total_s"]):
        share = st["total_s"] / wall if wall else 0.0
        table[name] = {
            "count": int(st["count"]),
            "mean_ms": round(1000 * st["total_s"] / st["count"], 3) if st["count"] else 0.0,
            "max_ms": round(st["max_ms"], 3),
            "p95_ms": round(st["p95_ms"], 3),
            "share": round(share, 4),
        }
        if "device_s" in st and st["count"]:
            table[name]["device_mean_ms"] = round(1000 * st["device_s"] / st["count"], 3)
        if name in Stage.WAITS:
            waits[name] = share
        elif gpu_syncs and name in Stage.HOST_SYNCS and "device_s" in st and wall:
            work = min(st["device_s"], st["total_s"]) / wall
            groups[_group(name)] += work
            waits[name] = share - work
        else:
            groups[_group(name)] += share
    return table, groups, waits


def _worker_shares(steady: list[dict[str, Any]], wall: float, gpu_wait: float = 0.0) -> dict[str, float]:
    """Each worker's busy fraction of wall time, busiest first ({} without wall time); the
    optimizer's less its named syncs' wait for the GPU (`gpu_wait`, a share of wall time)."""
    workers: dict[str, float] = defaultdict(float)
    for p in steady:
        for w, frac in p.get("workers", {}).items():
            workers[w] += frac * p["wall_s"]
    if not wall:
        return {}
    shares = {w: v / wall for w, v in workers.items()}
    for w in shares:
        if _role(w) == "optimizer":
            shares[w] = max(shares[w] - gpu_wait, 0.0)
    return {w: round(v, 4) for w, v in sorted(shares.items(), key=lambda kv: -kv[1])}


def _bottleneck_busy(a: dict[str, Any]) -> float:
    """The busy fraction of the bottleneck: its busiest worker, or its role's summed stages."""
    b = a["bottleneck"]
    return max((v for w, v in a["workers"].items() if _role(w) == b), default=a["busy"].get(b, 0.0))


def _rank_figures(
    rank: int, records: list[dict[str, Any]], profiles: list[dict[str, Any]], steady: list[dict[str, Any]]
) -> dict[str, Any]:
    """One rank's figures for the per-rank table; `work_ms_per_step` is what the slowest
    rank is judged by: the busiest worker's busy time per optimizer step, all-reduce
    excluded (waiting there for the other ranks is no work of this rank's)."""
    a = _analyze(records, profiles, steady, ranked=True)
    wall = a["wall_s"]
    ar = sum(p["stages"].get(Stage.ALLREDUCE, {}).get("total_s", 0.0) for p in steady)
    steps = sum(int(p.get("steps") or 0) for p in steady)
    if not steps:  # records without a step counter: one optimizer step per drafter.optimizer_step
        steps = a["stages"].get(Stage.OPTIMIZER_STEP, {}).get("count", 0)
    work: dict[str, float] = defaultdict(float)
    for p in steady:
        for w, frac in p.get("workers", {}).items():
            if w != "loop":
                work[w] += frac * p["wall_s"]
    if not work:  # no per-worker figures: the roles' summed stages
        work.update({g: v * wall for g, v in a["busy"].items()})
    if "optimizer" in work:
        work["optimizer"] = max(0.0, work["optimizer"] - ar)
    busiest = max(work, key=lambda w: work[w]) if work else None
    work_s = work[busiest] if busiest else 0.0
    return {
        "rank": rank,
        "windows": a["windows"],
        "wall_s": wall,
        "tokens_per_s": a["tokens_per_s"],
        "steps": steps,
        "steps_per_s": round(steps / wall, 3) if wall else 0.0,
        "busy": a["busy"],
        "workers": a["workers"],
        "bottleneck": a["bottleneck"],
        "bottleneck_busy": round(_bottleneck_busy(a), 4),
        "allreduce_share": round(ar / wall, 4) if wall else 0.0,
        "allreduce_ms_per_step": round(1000 * ar / steps, 3) if steps else None,
        "busiest_worker": busiest,
        "work_ms_per_step": round(1000 * work_s / steps, 3) if steps else None,
        "work_share": round(work_s / wall, 4) if wall else 0.0,
    }


def _analyze_ranks(records: list[dict[str, Any]], by_rank: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Several ranks: the stage table and busy fractions over all of them (so shares are
    means over the ranks; throughput is their sum), and each rank on its own."""
    profiles: list[dict[str, Any]] = []
    steady: list[dict[str, Any]] = []
    ranks = []
    for rank, recs in by_rank.items():
        prof, st = _steady(recs)
        profiles += prof
        steady += st
        if prof:
            ranks.append(_rank_figures(rank, recs, prof, st))
        else:
            ranks.append({"rank": rank, "windows": 0})
    a = _analyze(records, profiles, steady, ranked=True)
    measured = sum(r.get("tokens_per_s", 0.0) for r in ranks)
    busy = _bottleneck_busy(a)
    a["tokens_per_s"] = round(measured, 2)
    a["bound_tokens_per_s"] = round(measured / busy, 2) if busy > 0 else None
    start = next((r for r in records if r.get("event") == "run_start" and "world_size" in r), None)
    world = max(start["world_size"] if start else 0, max(by_rank) + 1)
    timed = [r for r in ranks if r["windows"]]
    # Per step where every rank counts steps; else per second of wall time.
    key = "work_ms_per_step" if all(r["work_ms_per_step"] is not None for r in timed) else "work_share"
    slowest = max(timed, key=lambda r: r[key]) if len(timed) > 1 else None
    a.update({
        "world_size": world,
        "backend": start.get("backend") if start else None,
        "ranks": ranks,
        "missing_ranks": [r for r in range(world) if r not in by_rank],
        "slowest_rank": slowest["rank"] if slowest else None,
        "slowest_by": key if slowest else None,
    })  # fmt: skip
    return a


def _what_if(records: list[dict[str, Any]], stages: dict[str, dict[str, float]], groups: dict[str, float]) -> Any:
    """Batches/s that other target : drafter splits of the same devices would reach.

    Per batch, a target chain is busy t_T (its stages' time / batches) and a drafter replica
    t_D; with n_t chains and n_d replicas and queues deep enough to absorb jitter, the
    pipeline runs at min(n_t / t_T, n_d / t_D) — the slower side. Only meaningful when each
    chain and replica has a device of its own (GPUs), not for "cpu" entries sharing cores.
    """
    start = next((r for r in records if r.get("event") == "run_start"), None)
    batches = stages.get(Stage.TARGET_PACK, {}).get("count", 0)
    micro = stages.get(Stage.DRAFTER_BACKWARD, {}).get("count", 0)
    if start is None or not batches or not micro:
        return None
    pipe = start["config"]["pipeline"]
    n_t, n_d = len(pipe["target_devices"]), len(pipe["drafter_devices"])
    t_target = sum(s["total_s"] for n, s in stages.items() if _group(n) == "target" and n not in Stage.WAITS) / batches
    t_draft = sum(s["total_s"] for n, s in stages.items() if _group(n) == "drafter" and n not in Stage.WAITS) / micro
    total = n_t + n_d
    splits = {f"{a}:{total - a}": round(min(a / t_target, (total - a) / t_draft), 3) for a in range(1, total)}
    best = max(splits, key=lambda k: splits[k]) if splits else None
    return {
        "now": f"{n_t}:{n_d}",
        "target_s_per_batch": round(t_target, 4),
        "drafter_s_per_batch": round(t_draft, 4),
        "batches_per_s": splits,
        "best": best,
        "shared_cpu": all(d == "cpu" for d in [*pipe["target_devices"], *pipe["drafter_devices"]]),
    }


def timeline(profiles: list[dict[str, Any]]) -> list[float]:
    """Each profile window's end, in seconds from the first window's start."""
    return list(itertools.accumulate(p.get("wall_s", 0.0) for p in profiles))


def busiest(profiles: list[dict[str, Any]], n: int) -> list[str]:
    """The `n` stages with the most time over the windows (waits left out)."""
    names = {s for p in profiles for s in p.get("stages", {}) if s not in Stage.WAITS}
    return sorted(names, key=lambda s: -sum(p["stages"].get(s, {}).get("total_s", 0) for p in profiles))[:n]


def plot(records: list[dict[str, Any]], path: str) -> None:
    """Stage times (mean ms per window) and hidden-state queue depth over the run, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        msg = "--plot needs matplotlib: pip install matplotlib"
        raise DataError(msg) from None
    by_rank = _ranks(records)
    title = "dflash: stage times and hidden-state queue"
    if by_rank is not None:  # several ranks: the first one's windows (their times interleave)
        rank, records = next(iter(by_rank.items()))
        title += f" (rank {rank})" if len(by_rank) > 1 else ""
    profiles = [r for r in records if r.get("event") == "profile" and not r.get("final")]
    if not profiles:
        msg = "no profile records in the log to plot"
        raise DataError(msg)
    t, names = timeline(profiles), busiest(profiles, 8)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for n in names:
        ax1.plot(t, [p["stages"].get(n, {}).get("mean_ms", 0) for p in profiles], label=n, marker=".")
    ax1.set_ylabel("mean ms per call")
    ax1.legend(fontsize=7)
    ax1.set_title(title)
    q = [p["queues"].get("hidden_states", {}) for p in profiles]
    ax2.plot(t, [x.get("mean_depth", 0) for x in q], label="mean depth")
    ax2.plot(t, [x.get("max_depth", 0) for x in q], label="max depth")
    ax2.set_ylabel("queue depth")
    ax2.set_xlabel("seconds")
    ax2.legend(fontsize=7)
    for p, x in zip(profiles, t, strict=True):
        if p.get("warmup"):
            ax1.axvspan(x - p["wall_s"], x, color="0.9")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _stage_rows(a: dict[str, Any]) -> list[str]:
    """The run's windows, then a row per counted stage: its times and share (TFLOP/s and MFU
    where the profile measured them)."""
    lines = [
        f"{a['windows']} steady windows ({a['warmup_windows_dropped']} warm-up/final dropped), {a['wall_s']:.1f} s",
        "",
        f"{'stage':32} {'count':>7} {'mean ms':>10} {'p95 ms':>10} {'max ms':>10} {'share':>7}",
    ]
    if a.get("roofline"):
        lines[-1] += f" {'TFLOP/s':>9} {'MFU':>6}"
    for name, s in a["stages"].items():
        if "count" not in s:
            continue
        row = (
            f"{name:32} {s['count']:>7} {s['mean_ms']:>10.2f} {s['p95_ms']:>10.2f} {s['max_ms']:>10.2f} "
            f"{100 * s['share']:>6.1f}%"
        )
        if "tflops" in s:
            row += f" {s['tflops']:>9.3f} " + (f"{100 * s['mfu']:>5.1f}%" if "mfu" in s else f"{'-':>6}")
        lines.append(row)
    return lines


def _busy_lines(a: dict[str, Any]) -> list[str]:
    """How busy each role and worker was, and the bottleneck (the drafter's GPU when the host
    mostly waits for it in the named syncs)."""
    busy = ", ".join(f"{g} {100 * v:.0f}%" for g, v in a["busy"].items())
    lines = [f"busy by role (summed over its workers): {busy}"]
    if a["workers"]:
        lines.append("busy by worker: " + ", ".join(f"{w} {100 * v:.0f}%" for w, v in a["workers"].items()))
    if a.get("gpu_bound"):
        top = next(iter(a["workers"].items()), None)
        lines.append(
            f"bottleneck: the drafter's GPU: the host waits for its queued work {100 * a['gpu_bound']:.0f}% of wall "
            "time in the named syncs (drafter.grad_norm_sync, metrics.sync)"
            + (f"; the busiest host worker is {top[0]} ({100 * top[1]:.0f}%)" if top else "")
        )
    else:
        lines.append(f"bottleneck: {a['bottleneck']} ({100 * _bottleneck_busy(a):.0f}% busy)")
    return lines


def _wait_lines(a: dict[str, Any]) -> list[str]:
    """Where the workers wait: drafters starved of features, the host waiting for the GPU in
    its named syncs, targets back-pressured."""
    lines = []
    starve = a["waits"].get(Stage.DRAFTER_QUEUE_WAIT, 0.0)
    back = a["waits"].get(Stage.TARGET_QUEUE_PUT, 0.0)
    if starve > 0.05 and back > 0.05:
        lines.append(
            "both sides wait at times: a deeper hidden-state queue (pipeline.hs_queue_depth) would absorb "
            "the jitter, up to the bound below"
        )
    if starve > 0.05:
        lines.append(f"drafters are starved: {100 * starve:.0f}% of wall time waiting for hidden states")
    gpu_wait = {k: v for k, v in a["waits"].items() if k in Stage.HOST_SYNCS and v > 0}
    if sum(gpu_wait.values()) > 0.05 and not a.get("gpu_bound"):
        each = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(gpu_wait.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"the host waits for the GPU {100 * sum(gpu_wait.values()):.0f}% of wall time in its named syncs "
            f"({each}): the device's queued work, not host work, sets the pace there (counted as waiting, "
            "not as the optimizer's work)"
        )
    if back > 0.05:
        lines.append(f"targets are back-pressured: {100 * back:.0f}% of wall time waiting to hand over features")
    return lines


def _roofline_lines(a: dict[str, Any]) -> list[str]:
    """The devices' peaks and the stage furthest below its device's peak (with the throughput
    if every device ran at the best stage's MFU)."""
    roof = a.get("roofline")
    if not roof or not roof.get("furthest_below"):
        return []
    peaks = "; ".join(f"{d} {p['tflops']:g} TFLOP/s ({p['source']}, {p['dtype']}, {p['name']})"
                      for d, p in roof["peaks"].items())  # fmt: skip
    worst = roof["furthest_below"]
    line = f"MFU: furthest below its device's peak: {worst} ({100 * a['stages'][worst]['mfu']:.1f}%)"
    if "bound_tokens_per_s" in roof:
        line += (
            f"; {roof['bound_tokens_per_s']:.0f} tok/s if every device ran at {roof['mfu_of']}'s MFU "
            f"({100 * roof['at_mfu']:.1f}%)"
        )
    return [f"peaks: {peaks}", line]


def _what_if_line(w: dict[str, Any]) -> str:
    """Each side's busy time a batch and the batches/s of the split now and of the best one."""
    now, best = w["batches_per_s"].get(w["now"]), w["best"]
    return (
        f"per batch: target {1000 * w['target_s_per_batch']:.0f} ms busy, drafter "
        f"{1000 * w['drafter_s_per_batch']:.0f} ms busy; split now {w['now']}"
        + (f" ({now:.2f} batches/s)" if now else "")
        + f", best {best} ({w['batches_per_s'][best]:.2f} batches/s)"
        + (" — devices are all 'cpu' here, so splits share cores: indicative only" if w["shared_cpu"] else "")
    )


def format_report(a: dict[str, Any]) -> str:
    """The analysis for people: the stage table, busy fractions and bottleneck, waits,
    throughput and its bounds, then one row per rank where there are several."""
    lines = [*_stage_rows(a), "", *_busy_lines(a), *_wait_lines(a)]
    if a["bound_tokens_per_s"]:
        lines.append(
            f"throughput: {a['tokens_per_s']:.0f} tok/s measured; {a['bound_tokens_per_s']:.0f} tok/s if the "
            f"{a['bottleneck']} worker never idled"
        )
    lines += _roofline_lines(a)
    if a.get("what_if"):
        lines.append(_what_if_line(a["what_if"]))
    if a["cuda"] and a["host_share"] > 0.9 and not a.get("gpu_bound"):
        lines.append(
            f"host work sums to {100 * a['host_share']:.0f}% of wall time: one process holding the GIL "
            "is near its limit; more devices will not help"
        )
    if "ranks" in a:
        n = len(a["ranks"])
        head = (
            f"{n} rank{'s' if n > 1 else ''} (world size {a['world_size']}, {a['backend'] or 'backend unknown'}): "
            "windows and seconds below add up the ranks; stage shares and busy fractions are means over them, "
            "throughput their sum"
        )
        lines = [head, *lines, "", *_rank_lines(a)]
    return "\n".join(lines)


def _rank_lines(a: dict[str, Any]) -> list[str]:
    ranks = [r for r in a["ranks"] if r["windows"]]
    roles = [g for g in ("data", "target", "drafter", "optimizer") if any(g in r["busy"] for r in ranks)]
    lines = [
        "per rank: busy = stage time per wall second by role; all-reduce = share of drafter.allreduce; "
        "work/step = the busiest worker's ms per optimizer step, all-reduce excluded",
        f"{'rank':>4} {'tok/s':>9} {'steps/s':>8} " + " ".join(f"{g:>9}" for g in roles)
        + f" {'all-reduce':>10} {'work/step':>10}  bottleneck",
    ]  # fmt: skip
    for r in a["ranks"]:
        if not r["windows"]:
            lines.append(f"{r['rank']:>4} no profile records")
            continue
        work = f"{r['work_ms_per_step']:.2f}" if r["work_ms_per_step"] is not None else "-"
        lines.append(
            f"{r['rank']:>4} {r['tokens_per_s']:>9.0f} {r['steps_per_s']:>8.2f} "
            + " ".join(f"{100 * r['busy'].get(g, 0.0):>8.0f}%" for g in roles)
            + f" {100 * r['allreduce_share']:>9.1f}% {work:>10}  {r['bottleneck']} "
            f"({100 * r['bottleneck_busy']:.0f}% busy)"
        )
    if a["slowest_rank"] is not None:
        slow = next(r for r in ranks if r["rank"] == a["slowest_rank"])
        per_step = a["slowest_by"] == "work_ms_per_step"
        key = a["slowest_by"]
        fast = min(ranks, key=lambda r: r[key])

        def fig(r: dict[str, Any]) -> str:
            return f"{r[key]:.2f} ms" if per_step else f"{100 * r[key]:.0f}% busy"

        rule = "per optimizer step" if per_step else "per second of wall time"
        lines.append(
            f"slowest rank: {slow['rank']} ({slow['busiest_worker']} {fig(slow)}; fastest rank {fast['rank']} "
            f"{fig(fast)}); slowest = the most work {rule} on one worker, {Stage.ALLREDUCE} excluded (time "
            "there is mostly waiting for the slowest rank)"
        )
    if Stage.ALLREDUCE in a["stages"]:
        each = ", ".join(f"rank {r['rank']} {100 * r['allreduce_share']:.1f}%" for r in ranks)
        ms = [r["allreduce_ms_per_step"] for r in ranks if r["allreduce_ms_per_step"] is not None]
        lines.append(
            f"cross-node all-reduce ({Stage.ALLREDUCE}): {100 * a['stages'][Stage.ALLREDUCE]['share']:.1f}% of wall "
            f"time over the ranks ({each})" + (f", {sum(ms) / len(ms):.2f} ms per step" if ms else "")
        )
    if a["missing_ranks"]:
        missing = ", ".join(str(r) for r in a["missing_ranks"])
        lines.append(
            f"no records of rank {missing} (world size {a['world_size']}): name every rank's log, or the run folder"
        )
    return lines
