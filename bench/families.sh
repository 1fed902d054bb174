#!/usr/bin/env bash
# The drafter families side by side on the demo's data, at equal wall-clock: one regen
# (configs/demo.toml: 5 minutes of the target's replies, features kept), then for each entry
# the demo's training (3.75 minutes) and its eval on the 32 held-out prompts and the first 5
# MT-Bench questions. Prints one row per entry: held-out and MT-Bench τ, lossless, training
# steps and tok/s, drafter parameters. Logs: runs/families_<family>_b<block>/*.jsonl.
#   bash bench/families.sh                          # the four default entries (about 25 minutes on 2 cores)
#   FAMILIES="dflash:4 dflash2:5" bash bench/families.sh
#   SKIP_REGEN=1 bash bench/families.sh             # reuse runs/demo/regen.jsonl and its features
# An entry is family:block_size (drafter.block_size). The block holds the anchor and what the
# drafter predicts: DFlash and DFlash2 draft block − 1 tokens (DFlash2's convolution block is
# vLLM's 1 + num_speculative_tokens), DSpark all `block` (its first slot predicts the anchor's
# next token). The defaults compare each family at 4 drafted tokens, DFlash also at 3 (the block
# its recipe used before: the best of the two is the baseline).
# DFlash2 and DSpark run at rank 64 (selector / Markov head): their codebooks are vocab × rank,
# and at speculators' 256 the optimizer's work on them would outweigh the 1-layer drafter's.
set -euo pipefail
cd "$(dirname "$0")/.."
make --no-print-directory .venv/.dflash-demo-installed >/dev/null
FAMILIES=${FAMILIES:-"dflash:4 dflash:5 dflash2:5 dspark:4"}
for entry in $FAMILIES; do  # every entry checked before the first regen or run
  case $entry in
    dflash:[1-9] | dflash:[1-9][0-9] | dflash2:[1-9] | dflash2:[1-9][0-9] | dspark:[1-9] | dspark:[1-9][0-9]) ;;
    *) echo "bench/families.sh: '$entry' is not family:block_size (dflash, dflash2 or dspark; e.g. dflash2:5)" >&2; exit 2 ;;
  esac
done
mkdir -p runs/demo
if [ -z "${SKIP_REGEN:-}" ]; then
  bin/dflash regen configs/demo.toml > runs/demo/regen.log.jsonl
fi
names=()
for entry in $FAMILIES; do
  family=${entry%%:*} block=${entry#*:}
  name="families_${family}_b$block"
  names+=("$name")
  set -- --set "run.name=\"$name\"" --set "drafter.family=\"$family\"" --set "drafter.block_size=$block"
  case $family in  # (configs/demo.toml's family options back to their defaults for the other families)
    dflash) set -- "$@" --set drafter.dspark.markov_rank=256 ;;
    dflash2) set -- "$@" --set drafter.dspark.markov_rank=256 --set drafter.dflash2.selector_rank=64 ;;
    dspark) set -- "$@" --set drafter.dspark.markov_rank=64 ;;
  esac
  rm -rf "runs/$name"
  mkdir -p "runs/$name"
  bin/dflash run configs/demo.toml "$@" > "runs/$name/train.log.jsonl"
  bin/dflash eval configs/demo.toml "$@" --drafter "runs/$name/final" --prompts heldout > "runs/$name/eval.log.jsonl"
  bin/dflash eval configs/demo.toml "$@" --drafter "runs/$name/final" --prompts mtbench --num-prompts 5 \
    >> "runs/$name/eval.log.jsonl"
done
.venv/bin/python - "${names[@]}" <<'PY'
import json, sys
print(f"{'family':8} {'block':>5} {'heldout tau':>11} {'mtbench tau':>11} {'lossless':>8} {'steps':>6} {'tok/s':>7} {'params':>10}")
for name in sys.argv[1:]:
    run = f"runs/{name}"
    recs = [json.loads(l) for l in open(f"{run}/train.log.jsonl") if l.startswith("{")]
    end = next(r for r in recs if r["event"] == "run_end")
    setup = next(r for r in recs if r["event"] == "setup")
    evals = {r["prompt_set"]: r for r in map(json.loads, open(f"{run}/eval.log.jsonl")) if r.get("event") == "eval"}
    lossless = all(e["lossless"] for e in evals.values())
    family, block = name.removeprefix("families_").rsplit("_b", 1)
    print(f"{family:8} {block:>5} {evals['heldout']['tau']:>11.3f} {evals['mtbench']['tau']:>11.3f} {str(lossless):>8} "
          f"{end['steps']:>6} {end['tokens_per_s']:>7.0f} {setup['drafter_params']:>10}")
PY
