#!/usr/bin/env bash
# The demo's drafters in llama.cpp: each family's export from bench/families.sh (runs/families_<family>/final,
# trained on the demo's data) written to GGUF and drafted in llama-server beside the demo's Q4_1 target,
# on the 32 held-out prompts (greedy, 48 tokens); then one row per family: llama.cpp's τ against
# dflash's on the same prompts, outputs identical to llama.cpp's plain greedy / to dflash's float32
# greedy, llama-server's tokens/s with and without the drafter. Logs: runs/families_<family>/llamacpp.*
#   make llamacpp && bash bench/families.sh && bash bench/llamacpp.sh      # ~3 min a family after training
#   FAMILIES=dspark bash bench/llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
make --no-print-directory .venv/.dflash-demo-installed llamacpp >/dev/null
FAMILIES=${FAMILIES:-"dflash dflash2 dspark"}
for family in $FAMILIES; do
  name="families_$family"
  test -d "runs/$name/final" || { echo "runs/$name/final is missing: run bench/families.sh first" >&2; exit 1; }
  set -- --set "run.name=\"$name\"" --set "drafter.family=\"$family\""
  case $family in  # bench/families.sh's ranks
    dflash) set -- "$@" --set drafter.dspark.markov_rank=256 ;;
    dflash2) set -- "$@" --set drafter.dspark.markov_rank=256 --set drafter.dflash2.selector_rank=64 ;;
    dspark) set -- "$@" --set drafter.dspark.markov_rank=64 ;;
  esac
  bin/dflash eval configs/demo.toml "$@" --drafter "runs/$name/final" --prompts heldout --engine llamacpp \
    > "runs/$name/llamacpp.log.jsonl" 2> "runs/$name/llamacpp.err"
done
.venv/bin/python - $FAMILIES <<'PY'
import json, sys
print(f"{'family':8} {'tau llama.cpp':>13} {'tau dflash':>10} {'= llama.cpp greedy':>18} {'= dflash greedy':>15} {'tok/s':>6} {'plain':>6}")
for family in sys.argv[1:]:
    (r,) = [json.loads(l) for l in open(f"runs/families_{family}/llamacpp.log.jsonl") if l.startswith("{")]
    n = r["prompts"]
    print(f"{family:8} {r['tau']:>13.3f} {r['dflash_tau']:>10.3f} {str(r['identical_to_llamacpp_greedy']) + '/' + str(n):>18} "
          f"{str(r['identical_to_dflash_greedy']) + '/' + str(n):>15} {r['llamacpp_tokens_per_s']:>6} {r['llamacpp_plain_tokens_per_s']:>6}")
PY
