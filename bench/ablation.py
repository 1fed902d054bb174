"""Recipe ablation: train variants of one config on the same data and the same number of
steps, and report held-out τ (the run's end-of-run eval) and, for chat targets, MT-Bench τ
(`dflash eval --prompts mtbench`) per variant, as a markdown table and one JSON line.

    .venv/bin/python bench/ablation.py                                   # configs/demo.toml (needs `make demo` first)
    .venv/bin/python bench/ablation.py --config configs/tiny.toml --mtbench 0 --steps 128
    .venv/bin/python bench/ablation.py --variants baseline,wsd --set train.epochs=2

Every variant is `dflash run CONFIG --set run.name=ablation_<variant> ...` plus its
overrides; the demo's variants read the demo's regen output (`runs/demo/regen.jsonl`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (what it changes, --set overrides)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "baseline": ("the config as it is", []),
    "wsd": ("warmup-stable-decay schedule", ["schedule.kind='wsd'"]),
    "gamma_x2": ("flatter position weights (γ doubled)", []),  # γ filled in from the block size
    "noise": ("noise schedule: reveal 30 % of block slots, falling to 0", ["loss.noise_reveal_start=0.3"]),
    "init_target": ("draft layers start from the target's", ["drafter.init_from_target=true"]),
    "distill": (
        "distillation: half the loss is the cross-entropy to the target's top-32 (kept in the feature cache)",
        ["loss.distill=0.5"],
    ),
    "dpace": ("D-PACE position weights (α = 0.5)", ["loss.position_weights='dpace'"]),
    "target_labels": ("labels: the target's greedy token at each slot", ["loss.labels='target'"]),
}


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _dflash(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "bin" / "dflash"), *args], capture_output=True, text=True, cwd=ROOT)


def _gamma(config: Path, extra: list[str]) -> float:
    from dflash.config import load_config

    return load_config(config, extra).drafter.resolved_gamma


def run_variant(name: str, config: Path, steps: int | None, extra: list[str], mtbench: int) -> dict:
    what, sets = VARIANTS[name]
    if name == "gamma_x2":
        sets = [f"drafter.gamma={2 * _gamma(config, extra)}"]
    common = [f"run.name='ablation_{name}'", "eval.at_end=true", "checkpoint.at_end=false", *extra]
    if steps:
        common += [f"train.max_steps={steps}", "train.max_minutes=0"]  # the same steps: no time budget cuts one short
    t0 = time.perf_counter()
    proc = _dflash("run", str(config), *(a for s in [*common, *sets] for a in ("--set", s)))
    if proc.returncode != 0:
        return {"variant": name, "what": what, "error": proc.stderr.strip().splitlines()[-1][:200]}
    recs = _records(proc.stdout)
    end = recs[-1]
    ev = next((r for r in reversed(recs) if r["event"] == "eval"), {})
    row = {
        "variant": name, "what": what, "sets": sets, "steps": end["steps"], "train_s": end["train_s"],
        "final_loss": end["final_loss"], "tau_sim": end["final_tau_sim"], "heldout_tau": ev.get("tau"),
        "lossless": ev.get("lossless"), "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    if mtbench and end.get("export_dir"):
        e = _dflash("eval", str(config), "--drafter", end["export_dir"], "--prompts", "mtbench",
                    "--num-prompts", str(mtbench), *(a for s in common[:1] + extra for a in ("--set", s)))  # fmt: skip
        got = _records(e.stdout)
        row["mtbench_tau"] = got[-1]["tau"] if e.returncode == 0 and got else None
        if e.returncode != 0:
            row["mtbench_error"] = e.stderr.strip().splitlines()[-1][:200]
    return row


def table(rows: list[dict], mtbench: int) -> str:
    head = "| variant | what | steps | final loss | tau_sim | held-out τ |" + (
        f" MT-Bench τ ({mtbench} q.) |" if mtbench else ""
    )
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['variant']} | {r['what']} | failed: {r['error']} |")
            continue
        cells = [r["variant"], r["what"], str(r["steps"]), f"{r['final_loss']:.3f}", f"{r['tau_sim']:.3f}",
                 f"{r['heldout_tau']:.3f}" + ("" if r["lossless"] else " (NOT lossless)")]  # fmt: skip
        if mtbench:
            cells.append(f"{r['mtbench_tau']:.3f}" if r.get("mtbench_tau") is not None else "—")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.toml")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=None, help="train.max_steps for every variant (default: the config's)")
    ap.add_argument("--mtbench", type=int, default=10, help="MT-Bench questions per variant (0: skip)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="an override for every variant")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        sys.exit(f"ablation: unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    rows = []
    for name in names:
        print(f"ablation: {name} ...", file=sys.stderr, flush=True)
        rows.append(run_variant(name, args.config, args.steps, args.extra, args.mtbench))
    print(table(rows, args.mtbench))
    print(json.dumps({"bench": "ablation", "config": str(args.config), "rows": rows}))


if __name__ == "__main__":
    main()
