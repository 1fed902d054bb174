#!/usr/bin/env bash
# On a CUDA machine: exercise every CUDA path (streams per stage, events, pinned D2H, flex
# BlockMask with compiled flex_attention, bf16 autocast, CUDA memory in profiles) and measure
# tokens/s with a Qwen3-8B-shaped random target and a 5-layer drafter, pipeline vs serial,
# target and drafter on separate streams of one GPU. Prints the report of each run, then one
# JSON line. Not yet run on a GPU: no CUDA machine has been available to the project.
#   bash bench/gpu_check.sh            (from the repository root, after make setup / pip install -e .)
#   DRY_RUN=1 bash bench/gpu_check.sh  (CPU, tiny shapes: checks the script itself, ~1 minute)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
PY="${PYTHON:-python}"
extra=()
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  extra=(--set 'pipeline.target_devices=["cpu"]' --set 'pipeline.drafter_devices=["cpu"]'
         --set 'target.dtype="float32"' --set target.tiny.hidden_size=64 --set target.tiny.num_layers=4
         --set target.tiny.num_heads=4 --set target.tiny.num_kv_heads=2 --set target.tiny.head_dim=16
         --set target.tiny.intermediate_size=128 --set target.tiny.vocab_size=512 --set data.num_samples=64
         --set data.prompt_len=32 --set data.gen_len=32 --set data.max_seq_len=64 --set drafter.max_anchors=8
         --set drafter.sliding_window=32 --set train.max_steps=6 --set train.log_every=2
         --set profile.interval_s=1.0)
else
  "$PY" -c 'import sys, torch
if not torch.cuda.is_available(): sys.exit("gpu_check: no CUDA device here (DRY_RUN=1 checks the script on CPU)")
print("cuda:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
  "$PY" -m pytest -q tests/test_mask_loss_reference.py tests/test_eval.py  # CPU references still hold
fi
for mode in pipeline serial; do
  bin/dflash run configs/gpu_bench.toml --set "run.output_dir=\"$out/$mode\"" \
    --set "pipeline.mode=\"$mode\"" "${extra[@]}" --trace "$out/$mode.trace.json" > "$out/$mode.jsonl"
  bin/dflash report "$out/$mode.jsonl" | tee "$out/$mode.report.txt"
done
"$PY" - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
res = {}
for mode in ("pipeline", "serial"):
    recs = [json.loads(l) for l in open(f"{out}/{mode}.jsonl")]
    end = recs[-1]
    prof = [r for r in recs if r["event"] == "profile" and not r["warmup"]]
    res[mode] = {"tokens_per_s": end["tokens_per_s"], "steps": end["steps"],
                 "device_ms": {k: v.get("device_mean_ms") for k, v in prof[-1]["stages"].items()} if prof else {},
                 "cuda_memory": prof[-1]["memory"].get("cuda") if prof else None}
res["ratio"] = res["pipeline"]["tokens_per_s"] / max(res["serial"]["tokens_per_s"], 1e-9)
print(json.dumps({"bench": "gpu_check", **res}))
EOF
