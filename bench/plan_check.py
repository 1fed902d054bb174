"""`dflash plan` against what runs measure, on this machine, and against the seed's setting.

    .venv/bin/python bench/plan_check.py           # ~10 minutes on 2 cores; the demo's target: after `make demo`

1. Step time, calibrated then predicted: a run of a config (its profile's MFU per stage, host
   work per batch, optimizer seconds a step and mean batch: `dflash plan --calibrate LOG`)
   predicts the step time of another run (another seed) at the same batch size and at twice
   it, each then run and measured (its steady windows' wall time over their steps). The tiny
   config (batch 8), and the demo's models (SmolLM2-135M target, the DSpark drafter) on random
   data (batch 4).
2. Bottleneck: calibrated on the tiny config's 1 + 1 run, the plan names the bottleneck of
   three other splits of `bench/pipeline_vs_serial.py`'s config (the tiny one), each then
   run and named by `dflash report`.
3. The seed's setting (`bench/plan/seed.toml`: a dense 27B target, 5 + 3 H100s, token budget
   49,152, block 32, 1,024 anchors a batch, 5 draft layers) with the MFU fitted to its 12 s
   target forward: the bottleneck and tokens/s against its 14.5K tok/s.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DFLASH = str(ROOT / "bin" / "dflash")
COMMON = ["eval.at_end=false", "checkpoint.at_end=false", "checkpoint.export_final=false", "profile.interval_s=1.0",
          "train.max_minutes=0"]  # fmt: skip
DEMO = ['data.source="random"', "data.num_samples=256", "data.gen_len=96", 'target.dtype="float32"',
        "drafter.init_from_target=false", "data.feature_files=false", "data.feature_cache_mb=0"]  # fmt: skip
SEED_TOK_S = 14_500


def _sets(pairs: list[str]) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def run(config: str, out: Path, name: str, sets: list[str]) -> Path:
    log = out / f"{name}.jsonl"
    pairs = [*COMMON, f'run.output_dir="{out}"', f'run.name="{name}"', *sets]
    with log.open("w") as f:
        proc = subprocess.run([DFLASH, "run", config, *_sets(pairs)], stdout=f, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"dflash run {config} {sets}: {proc.stderr.strip().splitlines()[-1:]}")
    return log


def measured(log: Path) -> dict[str, Any]:
    from dflash.report import analyze, read_logs

    records = read_logs([str(log)])
    steady = [r for r in records if r.get("event") == "profile" and not r.get("warmup") and not r.get("final")]
    steps = sum(r["steps"] for r in steady)
    return {"step_s": sum(r["wall_s"] for r in steady) / steps if steps else float("nan"),
            "bottleneck": analyze(records)["bottleneck"]}  # fmt: skip


def planned(config: str, sets: list[str], *extra: str) -> dict[str, Any]:
    proc = subprocess.run([DFLASH, "plan", config, "--json", *_sets(sets), *extra], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"dflash plan {config}: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def main() -> None:
    out: dict[str, Any] = {"bench": "plan_check"}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, config, sets, steps, bs in (
            ("tiny", "configs/tiny.toml", [], 200, 8),
            ("demo", "configs/demo.toml", DEMO, 60, 4),
        ):
            at = [*sets, f"train.max_steps={steps}"]
            base = run(config, tmp, f"{name}-cal", [*at, f"data.batch_size={bs}"])
            for size, what in ((bs, "another run"), (2 * bs, "twice the batch")):
                p = planned(config, [*sets, f"data.batch_size={size}"], "--gpu", "cpu", "--calibrate", str(base))
                m = measured(run(config, tmp, f"{name}-{size}", [*at, f"data.batch_size={size}", "run.seed=1"]))
                ratio = p["step_s"] / m["step_s"]
                rows.append((f"{name}: step s, batch {size} ({what})", f"{p['step_s']:.4f}", f"{m['step_s']:.4f}",
                             f"{ratio:.3f}"))  # fmt: skip
                out[f"{name}_step_ratio_batch_{size}"] = round(ratio, 4)
            out[f"{name}_mfu"] = p["mfu"]
            out["peak_tflops"] = p["device"]["peak_tflops"]
            if name == "tiny":
                hits = []
                for t, dr in ((2, 1), (1, 2), (1, 3)):
                    devs = [f'pipeline.target_devices={json.dumps(["cpu"] * t)}',
                            f'pipeline.drafter_devices={json.dumps(["cpu"] * dr)}']  # fmt: skip
                    guess = planned(config, [*devs, f"data.batch_size={bs}"], "--gpu", "cpu", "--calibrate",
                                    str(base))["bottleneck"]  # fmt: skip
                    seen = measured(run(config, tmp, f"split-{t}-{dr}", [*devs, *at]))["bottleneck"]
                    hits.append(guess == seen)
                    rows.append((f"tiny {t} + {dr}: bottleneck", guess, seen, "ok" if guess == seen else "WRONG"))
                out["splits_right"] = f"{sum(hits)}/{len(hits)}"
    seed = planned("bench/plan/seed.toml", [], "--gpu", "h100", "--row-length", "2686", "--target-s", "12")
    cur = seed["current"]
    rows.append(("seed 5 + 3: tokens/s", f"{cur['tokens_per_s']:,.0f}", f"{SEED_TOK_S:,}",
                 f"{cur['tokens_per_s'] / SEED_TOK_S:.3f}"))  # fmt: skip
    rows.append(
        ("seed 5 + 3: bottleneck", cur["bottleneck"], "target", "ok" if cur["bottleneck"] == "target" else "WRONG")
    )
    out |= {"seed_tokens_per_s": cur["tokens_per_s"], "seed_ratio": round(cur["tokens_per_s"] / SEED_TOK_S, 4),
            "seed_bottleneck": cur["bottleneck"], "seed_mfu": seed["mfu"]["target.model_forward"],
            "seed_best": seed["best"]}  # fmt: skip
    print(f"{'check':48} {'planned':>12} {'measured':>12} {'ratio':>8}")
    for r in rows:
        print(f"{r[0]:48} {r[1]:>12} {r[2]:>12} {r[3]:>8}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
