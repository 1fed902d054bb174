#!/usr/bin/env bash
# The drafter families side by side on the demo's data, at equal wall-clock: one regen
# (configs/demo.toml: 5 minutes of the target's replies, features kept), then for each entry
# the demo's training (3.75 minutes) and its eval on the 32 held-out prompts and the first 5
# MT-Bench questions. Prints one row per entry: held-out and MT-Bench τ, lossless, training
# steps and tok/s, drafter parameters. Logs: runs/families_<family>_b<block>/*.jsonl.
#   bash bench/families.sh                          # the four default entries (about 25 minutes on 2 cores)
#   FAMILIES="dflash:4 dflash2:5" bash bench/families.sh
#   SKIP_REGEN=1 bash bench/families.sh             # reuse runs/demo/regen.jsonl and its features
# An entry is family:block_size (drafter.block_size; bench/family_entries.sh). The block holds
# the anchor and what the drafter predicts: DFlash and DFlash2 draft block − 1 tokens (DFlash2's convolution block is
# vLLM's 1 + num_speculative_tokens), DSpark all `block` (its first slot predicts the anchor's
# next token). The defaults compare each family at 4 drafted tokens, DFlash also at 3 (the block
# its recipe used before: the best of the two is the baseline).
# DFlash2 and DSpark run at rank 64 (selector / Markov head): their codebooks are vocab × rank,
# and at speculators' 256 the optimizer's work on them would outweigh the 1-layer drafter's.
# An entry given twice runs twice into one folder: give each once.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/family_entries.sh
make --no-print-directory .venv/.dflash-demo-installed >/dev/null
mkdir -p runs/demo
if [ -z "${SKIP_REGEN:-}" ]; then
  bin/dflash regen configs/demo.toml > runs/demo/regen.log.jsonl
fi
names=()
for entry in "${ENTRIES[@]}"; do
  entry_args "$entry"
  names+=("$NAME")
  rm -rf "runs/$NAME"
  mkdir -p "runs/$NAME"
  bin/dflash run configs/demo.toml "${ARGS[@]}" > "runs/$NAME/train.log.jsonl"
  bin/dflash eval configs/demo.toml "${ARGS[@]}" --drafter "runs/$NAME/final" --prompts heldout > "runs/$NAME/eval.log.jsonl"
  bin/dflash eval configs/demo.toml "${ARGS[@]}" --drafter "runs/$NAME/final" --prompts mtbench --num-prompts 5 \
    >> "runs/$NAME/eval.log.jsonl"
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
