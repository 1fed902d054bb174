#!/usr/bin/env bash
# The demo's drafters in llama.cpp: each entry's export from bench/families.sh
# (runs/families_<family>_b<block>/final, trained on the demo's data; the same family:block_size
# entries, bench/family_entries.sh) written to GGUF and drafted in llama-server beside the demo's
# Q4_1 target, on the 32 held-out prompts (greedy, 48 tokens); then one row per entry: llama.cpp's
# τ against dflash's on the same prompts, outputs identical to llama.cpp's plain greedy / to
# dflash's float32 greedy, llama-server's tokens/s with and without the drafter.
# Logs: runs/families_<family>_b<block>/llamacpp.*
#   make llamacpp && bash bench/families.sh && bash bench/llamacpp.sh      # ~3 min an entry after training
#   FAMILIES=dspark:4 bash bench/llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/family_entries.sh
make --no-print-directory .venv/.dflash-demo-installed llamacpp >/dev/null
names=()
for entry in "${ENTRIES[@]}"; do
  entry_args "$entry"
  names+=("$NAME")
  test -d "runs/$NAME/final" || { echo "runs/$NAME/final is missing: run bench/families.sh first" >&2; exit 1; }
  bin/dflash eval configs/demo.toml "${ARGS[@]}" --drafter "runs/$NAME/final" --prompts heldout --engine llamacpp \
    > "runs/$NAME/llamacpp.log.jsonl" 2> "runs/$NAME/llamacpp.err"
done
.venv/bin/python - "${names[@]}" <<'PY'
import json, sys
print(f"{'family':8} {'block':>5} {'tau llama.cpp':>13} {'tau dflash':>10} {'= llama.cpp greedy':>18} {'= dflash greedy':>15} {'tok/s':>6} {'plain':>6}")
for name in sys.argv[1:]:
    (r,) = [json.loads(l) for l in open(f"runs/{name}/llamacpp.log.jsonl") if l.startswith("{")]
    n = r["prompts"]
    family, block = name.removeprefix("families_").rsplit("_b", 1)
    print(f"{family:8} {block:>5} {r['tau']:>13.3f} {r['dflash_tau']:>10.3f} {str(r['identical_to_llamacpp_greedy']) + '/' + str(n):>18} "
          f"{str(r['identical_to_dflash_greedy']) + '/' + str(n):>15} {r['llamacpp_tokens_per_s']:>6} {r['llamacpp_plain_tokens_per_s']:>6}")
PY
