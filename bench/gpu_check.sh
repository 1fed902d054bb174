#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py: what it checks and measures, its tolerances and targets):
# every CUDA path of dflash against its CPU references, host syncs, races across streams, and
# the figures of one GPU — at most 6 minutes on one H200, warm-up included. Prints one line
# per check (PASS / FAIL / SKIP <name> <detail>) and per measure (MEASURE <name> <figures>),
# then ONE JSON line {"bench": "gpu_check", ...}. Results go to $OUT if set, else
# runs/gpu_check: gpu_check.json (also written as it goes), gpu_check.out (stdout),
# gpu_check.stderr.log, runs/<name>/records.jsonl per run, bench_<mode>.report.txt / .trace.json.
#
# On a machine with internet, once (wheels of what the GPU machine's python may lack:
# structlog, safetensors, tokenizers, pydantic, tomli-w and their dependencies; wheels/ is
# ignored by git, so carry it along explicitly):
#   make gpu-wheels                     # CPython 3.11; another: make gpu-wheels GPU_PYTHON_VERSION=3.12
# On the GPU machine, from a fresh copy of the repository (its own torch and transformers,
# no internet, no install of dflash: PYTHONPATH=.):
#   bash bench/gpu_check.sh             # PYTHON=/path/to/python to choose the interpreter
# (through the project's device tool: command "bash bench/gpu_check.sh", carry ["wheels"],
# timeout_s 420; $OUT comes back.)
# On CPU, with tiny shapes (the same code; the checks that need CUDA print SKIP; under a minute):
#   DRY_RUN=1 bash bench/gpu_check.sh
# Knobs: GPU_CHECK_BUDGET_S (320 s: a bench measure starts only if what it needs is left),
# GPU_CHECK_TIMEOUT_S (350 s: the hard limit of the Python part), GPU_CHECK_BENCH_STEPS (12 per mode).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${OUT:-runs/gpu_check}"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ "${DRY_RUN:-0}" == 1 && -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

fail_json() {  # the one JSON line, when gpu_check.py could not write its own
  local partial="null"
  [[ -s "$out/gpu_check.json" ]] && partial="$(cat "$out/gpu_check.json")"
  printf '{"bench": "gpu_check", "ok": false, "error": "%s", "partial": %s}\n' "$1" "$partial"
}

# What this python lacks of dflash's requirements (torch and transformers must be there).
missing="$("$PY" - <<'EOF'
import importlib.util
need = {"torch": "torch", "transformers": "transformers", "click": "click", "structlog": "structlog",
        "safetensors": "safetensors", "tokenizers": "tokenizers", "pydantic": "pydantic", "tomli_w": "tomli-w"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
EOF
)" || { echo "gpu_check: cannot run $PY" >&2; fail_json "cannot run $PY"; exit 2; }
if [[ " $missing " == *" torch "* || " $missing " == *" transformers "* ]]; then
  echo "gpu_check: $PY has no torch or transformers (missing: $missing); set PYTHON=" >&2
  fail_json "no torch or transformers in $PY"
  exit 2
fi
if [[ -n "$missing" ]]; then
  echo "INFO gpu_check installing from wheels/: $missing"
  if [[ ! -d wheels ]]; then
    echo "gpu_check: $PY lacks $missing and there is no wheels/ folder (make gpu-wheels, then carry wheels/)" >&2
    fail_json "missing $missing and no wheels/"
    exit 2
  fi
  # shellcheck disable=SC2086  # one word per distribution
  if ! "$PY" -m pip install -q --no-index --find-links wheels/ $missing >"$out/pip.log" 2>&1; then
    # An externally managed or read-only python: install beside it. gpu_check.py puts this
    # folder after the python's own packages, so nothing it has is shadowed.
    export GPU_CHECK_SITE="$PWD/wheels/site"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-index --find-links wheels/ --target "$GPU_CHECK_SITE" $missing >>"$out/pip.log" 2>&1 \
      || { echo "gpu_check: pip install from wheels/ failed (see $out/pip.log)" >&2; tail -n 5 "$out/pip.log" >&2
           fail_json "pip install from wheels/ failed"; exit 2; }
  fi
fi

if ! err="$("$PY" -c 'import os, sys
if os.environ.get("GPU_CHECK_SITE"): sys.path.append(os.environ["GPU_CHECK_SITE"])
import dflash.pipeline.coordinator, dflash.train.build' 2>&1)"; then
  echo "gpu_check: dflash does not import with $PY: $(tail -n 1 <<<"$err")" >&2
  fail_json "dflash does not import with $PY (see stderr)"
  exit 2
fi

rm -f "$out/gpu_check.json"
timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-350}" "$PY" bench/gpu_check.py --out "$out" \
  2>"$out/gpu_check.stderr.log" | tee "$out/gpu_check.out"
rc=$?
if ! tail -n 1 "$out/gpu_check.out" | grep -q '^{"bench": "gpu_check"'; then
  echo "gpu_check: bench/gpu_check.py ended with status $rc before its JSON line; last of its stderr:" >&2
  tail -n 30 "$out/gpu_check.stderr.log" >&2
  fail_json "gpu_check.py ended with status $rc (124: timed out)" | tee -a "$out/gpu_check.out"
  exit $(( rc ? rc : 1 ))
fi
exit "$rc"
