"""The live target (`target.engine = "vllm"`) over a run 4× longer: the trainer's anonymous
memory stays flat and the spool never holds more than one batch.

A tiny float32 Qwen3 (head dim 32, which vLLM's CPU attention takes) with a word-level ChatML
tokenizer and 18 chats, trained with `target.load = "head"` and the target's features served by
a vLLM engine the run starts, for S and 4S steps, each a fresh `dflash run` in the engines venv;
the trainer's `RssAnon` is polled from /proc every 50 ms (vLLM's engine core is a process of its
own), and `run_end.target_engine` gives the spool's high-water mark and the requests sent.

    .venv/bin/python bench/live_target.py            # S = 20; needs .venv-engines (make engines)
    .venv/bin/python bench/live_target.py --remote   # target.engine = "remote": the trainer in .venv,
                                                     # `dflash serve-target` (vLLM) in a process beside it

The last line is one JSON object: steps, rss_anon_mb per run, rss_anon_growth, spool_max.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scale import watch_rss_anon  # noqa: E402

ENGINES_PY = ROOT / ".venv-engines" / "bin" / "python"


def _run(config: Path, steps: int, remote: bool) -> dict[str, Any]:
    sets = {
        "data.feature_cache_mb": "0", "data.feature_files": "false", "train.epochs": str(steps // 3 + 1),
        "train.max_steps": str(steps), "target.dtype": '"float32"', "target.engine": '"vllm"',
        "target.load": '"head"', "run.name": f'"live{steps}"',
    }  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the KV cache: sized by dflash
    cmd = [str(ENGINES_PY), "-m", "dflash", "run", str(config)]
    server = None
    if remote:
        spool = config.parent / f"spool{steps}"
        sets |= {"target.engine": '"remote"', "target.engine_spool": f'"{spool}"', "target.engine_timeout_s": "600"}
        cmd[0] = sys.executable
        server = subprocess.Popen(
            [str(ENGINES_PY), "-m", "dflash", "serve-target", str(config), "--spool", str(spool),
             "--set", 'target.dtype="float32"'],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=env,
        )  # fmt: skip
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    peak, done = watch_rss_anon(proc.pid, 0.05)
    assert proc.stdout is not None
    records = [json.loads(line) for line in proc.stdout]
    proc.wait()
    done.set()
    if server is not None and server.wait(timeout=120) != 0:
        raise SystemExit(f"dflash serve-target for {config} ({steps} steps) failed (exit {server.returncode})")
    if proc.returncode != 0:
        raise SystemExit(f"dflash run {config} ({steps} steps) failed (exit {proc.returncode})")
    end = records[-1]
    return {"steps": steps, "rss_anon_mb": round(peak[0] / 1024, 1), **end["target_engine"],
            "tokens_per_s": end["tokens_per_s"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="the shorter run's steps (S); the longer one runs 4S")
    ap.add_argument("--remote", action="store_true", help="target.engine = 'remote' against `dflash serve-target`")
    args = ap.parse_args()
    if not ENGINES_PY.exists():
        raise SystemExit(f"{ENGINES_PY} is missing: make engines")
    from tests.test_engine_features import _setup  # the tiny target and chats the engine tests use

    root = Path(tempfile.mkdtemp(prefix="dflash-live-"))
    config = _setup(root)
    runs = [_run(config, s, args.remote) for s in (args.steps, 4 * args.steps)]
    for r in runs:
        print(f"{r['steps']:>4} steps: RssAnon {r['rss_anon_mb']} MB, spool at most {r['spool_max']} requests, "
              f"{r['requests']} requests, {r['tokens_per_s']} tok/s", flush=True)  # fmt: skip
    a, b = runs
    print(json.dumps({
        "steps": [a["steps"], b["steps"]], "rss_anon_mb": [a["rss_anon_mb"], b["rss_anon_mb"]],
        "rss_anon_growth": round(b["rss_anon_mb"] / a["rss_anon_mb"] - 1, 4),
        "spool_max": max(a["spool_max"], b["spool_max"]), "engine": a["engine"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
