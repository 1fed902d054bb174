"""The asynchronous pipeline against a serial loop over the same stages, on this machine.

    .venv/bin/python bench/pipeline_vs_serial.py              # tiny config
    .venv/bin/python bench/pipeline_vs_serial.py --config configs/demo.toml \
        --set train.epochs=1 --depth-epochs 2                   # demo (after its regen)

`pipeline.mode = "serial"` calls every stage's function one after another in a plain loop
(dflash/pipeline/serial.py) — the loop of the usual trainers (target forward, then drafter forward/backward,
then the step), with the same code, data and steps. Runs alternate between the two modes.
Also sweeps `pipeline.hs_queue_depth` to show that memory is bounded by the queues, not
by the length of the run. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: str, out: Path, extra: list[str]) -> dict:
    cmd = [
        str(ROOT / "bin" / "dflash"), "run", config, "--set", f'run.output_dir="{out}"',
        "--set", "eval.at_end=false", "--set", "checkpoint.at_end=false", "--set", "checkpoint.export_final=false",
        "--set", "profile.interval_s=1.0",
        # Both modes run the target and the drafters: no seeding from regen's feature files,
        # no time budget cutting the runs to different lengths (the demo config has both).
        "--set", "data.feature_files=false", "--set", "train.max_minutes=0",
    ]  # fmt: skip
    for e in extra:
        cmd += ["--set", e]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:  # dflash's own one-line error says what was wrong
        last = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        sys.exit(f"pipeline_vs_serial: {last[0]}")
    recs = [json.loads(line) for line in proc.stdout.splitlines()]
    rss = [r["memory"]["host_rss_mb"] for r in recs if r["event"] == "profile"]
    end = recs[-1]
    return {"tok_s": end["tokens_per_s"], "loss": end["final_loss"], "rss_first": rss[0], "rss_max": max(rss),
            "rss_last": rss[-1]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.toml"))
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (0: only the queue-depth sweep)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (repeatable)",
    )
    ap.add_argument("--depth-epochs", type=int, default=8, help="epochs of each hs_queue_depth run")
    args = ap.parse_args()
    res: dict[str, list[dict]] = {"pipeline": [], "serial": []}
    depth: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.runs):
            for mode in ("pipeline", "serial"):
                res[mode].append(run(args.config, Path(d) / f"{mode}{i}", [*args.overrides, f'pipeline.mode="{mode}"']))
        for q in (1, 8, 64):
            extra = [*args.overrides, f"pipeline.hs_queue_depth={q}", f"train.epochs={args.depth_epochs}"]
            depth[q] = run(args.config, Path(d) / f"q{q}", extra)
    med = {m: statistics.median(r["tok_s"] for r in rs) for m, rs in res.items() if rs}
    ratio = round(med["pipeline"] / med["serial"], 4) if med else None
    print(f"{'mode':10} {'median tok/s':>13} {'runs':>30} {'final loss':>11} {'max RSS MB':>11}")
    for m, rs in res.items():
        runs = " / ".join(f"{r['tok_s']:.0f}" for r in rs)
        if rs:
            print(f"{m:10} {med[m]:>13.0f} {runs:>30} {rs[0]['loss']:>11} {max(r['rss_max'] for r in rs):>11.0f}")
    if ratio is not None:
        print(f"pipeline / serial: {ratio:.3f}")
    print(f"{'hs_queue_depth':>15} {'RSS first MB':>13} {'RSS max MB':>11} {'RSS last MB':>12}")
    for q, r in depth.items():
        print(f"{q:>15} {r['rss_first']:>13.0f} {r['rss_max']:>11.0f} {r['rss_last']:>12.0f}")
    print(json.dumps({"bench": "pipeline_vs_serial", "config": args.config, "overrides": args.overrides,
                      "tok_s": {m: [r["tok_s"] for r in rs]
                      for m, rs in res.items()}, "ratio": ratio,
                      "same_loss": len({r["loss"] for rs in res.values() for r in rs}) == 1 if med else None,
                      "rss_by_queue_depth": depth}))  # fmt: skip


if __name__ == "__main__":
    main()
