#!/usr/bin/env bash
# vLLM at both ends, the trainer holding only the target's embeddings and LM head, on the demo's
# target (SmolLM2-135M-Instruct, converted from its GGUF by `make demo`), on CPU:
#   1. vLLM writes the replies to chatterbot prompts (regen.engine = "vllm", REGEN_MINUTES),
#   2. vLLM computes their target features (`dflash features`),
#   3. a drafter trains from them with target.load = "head" (TRAIN_MINUTES), and, for memory and
#      losses, two short runs of STEPS steps: head only and the whole target, side by side,
#   4. vLLM decodes the held-out prompts with the export (`dflash eval --engine vllm`).
# Needs `make demo` (its packages and converted target) and `make engines`. Prints the figures.
# Usage: bash bench/engines_e2e.sh [OUT_DIR]    (about 15 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-/tmp/dflash-engines-e2e}")
REGEN_MINUTES=${REGEN_MINUTES:-2}
TRAIN_MINUTES=${TRAIN_MINUTES:-3.75}
STEPS=${STEPS:-40}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1
M=$(ls -dt ~/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1-* 2>/dev/null | head -1)
[ -n "$M" ] || { echo "engines_e2e: no converted demo target in ~/.cache/dflash/models: run make demo first" >&2; exit 1; }
[ -x .venv-engines/bin/dflash ] || { echo "engines_e2e: no .venv-engines: run make engines first" >&2; exit 1; }
mkdir -p "$OUT"
.venv/bin/python -c "import json; from dflash.data.prompts import chatterbot_prompts as c; print(*(json.dumps({'messages': p[0]}) for p in c()), sep='\n')" > "$OUT/chatterbot.jsonl"
DATA="$OUT/runs/e2e/regen.jsonl"
S=(--set 'target.kind="hf"' --set "target.path=\"$M\"" --set 'target.dtype="float32"'
   --set "run.output_dir=\"$OUT/runs\"" --set 'run.name="e2e"' --set "regen.prompts=\"$OUT/chatterbot.jsonl\""
   --set "data.files=[{path = \"$DATA\"}]" --set drafter.init_from_target=false)
HEAD=(--set 'target.load="head"' --set eval.at_end=false)
t() { /usr/bin/time -f "$1: %e s wall, %M KB max RSS" "${@:2}"; }

t regen .venv-engines/bin/dflash regen configs/demo.toml "${S[@]}" --set 'regen.engine="vllm"' \
  --set regen.save_features=false --set "regen.max_minutes=$REGEN_MINUTES" > "$OUT/regen.jsonl.log"
t features .venv-engines/bin/dflash features configs/demo.toml "${S[@]}" > "$OUT/features.log"
for load in head whole; do
  t "short run, target.load=$load" bin/dflash run configs/demo.toml "${S[@]}" --set "target.load=\"$load\"" \
    --set eval.at_end=false --set "run.name=\"short_$load\"" --set train.max_minutes=0 \
    --set "train.max_steps=$STEPS" --set checkpoint.at_end=false > "$OUT/short_$load.log"
done
t train bin/dflash run configs/demo.toml "${S[@]}" "${HEAD[@]}" --set "train.max_minutes=$TRAIN_MINUTES" > "$OUT/train.log"
t eval .venv-engines/bin/dflash eval configs/demo.toml "${S[@]}" --set 'target.load="head"' \
  --drafter "$OUT/runs/e2e/final" --prompts heldout --engine vllm > "$OUT/eval.log"

.venv/bin/python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
recs = lambda name: [json.loads(l) for l in (out / name).read_text().splitlines() if l.startswith("{")]
ev = lambda name, e: [r for r in recs(name) if r["event"] == e]
print("regen:", {k: ev("regen.jsonl.log", "regen")[0][k] for k in ("generated", "tokens_per_s", "engine_start_s")})
print("features:", {k: ev("features.log", "features")[0][k] for k in ("written", "tokens", "wall_s")})
losses = {load: [r["loss"] for r in ev(f"short_{load}.log", "train_step")] for load in ("head", "whole")}
print("short runs, losses equal:", losses["head"] == losses["whole"], losses["head"][-3:])
end = ev("train.log", "run_end")[0]
print("train:", {k: end.get(k) for k in ("steps", "tokens_per_s", "final_loss", "final_tau_sim")}, end["feature_cache"])
r = ev("eval.log", "eval")[0]
print("eval:", {k: r[k] for k in ("prompts", "tau", "verify_steps", "accept_per_position", "identical_to_vllm_greedy", "lossless")})
EOF
