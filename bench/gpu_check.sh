#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py: what it checks and measures, its tolerances and targets):
# every CUDA path of dflash against its CPU references, host syncs, races across streams, and
# the figures of one GPU — at most 6 minutes on one H200 for the whole script, warm-up, install
# from wheels/ and packing included. Prints one line per check (PASS / FAIL / SKIP <name>
# <detail>) and per measure (MEASURE <name> <figures>); its LAST line is ONE JSON line
# {"bench": "gpu_check", "ok": ...}. Exit status 0 when every check and measure passed, 1 when
# one failed, 2 when it could not start, 124 when its Python part ran out of time.
#
# What it leaves in $OUT (else runs/gpu_check), at most 5 plain files, no folder, each under
# 16 MiB: gpu_check.json (the JSON line, also written as it goes), gpu_check.out (stdout),
# gpu_check.stderr.log, pip.log (only when it installed from wheels/), and runs.tar.gz: the
# run folders (runs/<name>/records.jsonl, config.toml), bench_<mode>.report.txt and
# bench_<mode>.trace.json, kept under 15 MiB (without the traces if they would not fit). The
# runs themselves go to a temporary folder outside $OUT (GPU_CHECK_WORK=DIR to keep them).
#
# On a machine with internet, once: the wheels of what the GPU machine's python lacks (structlog,
# pydantic, pydantic-core, annotated-types, typing-inspection, tomli-w: CPython 3.12, x86-64
# manylinux or pure; pinned to .venv's versions; wheels/ is ignored by git, so carry it along):
#   make gpu-wheels
#   make gpu-compat                     # the GPU machine's torch and transformers in .venv-gpu, on CPU
#   bash bench/gpu_ready.sh             # every check that can run before a GPU is at hand: READY
# On the GPU machine, from a fresh copy of the repository (its own torch and transformers,
# no internet, no install of dflash: PYTHONPATH=.; what its python lacks is installed from
# wheels/ with --no-deps, beside the python where it cannot be written to):
#   bash bench/gpu_check.sh             # PYTHON=/path/to/python to choose the interpreter
# (through the project's device tool: command "bash bench/gpu_check.sh", carry ["wheels"],
# timeout_s 420; the files of $OUT come back.)
# On CPU, with tiny shapes (the same code; the checks that need CUDA print SKIP; about a minute):
#   DRY_RUN=1 bash bench/gpu_check.sh
# Knobs: GPU_CHECK_TOTAL_S (360 s: the whole script; the Python part gets what is left of it
# less 25 s for its kill grace and the packing), GPU_CHECK_TIMEOUT_S (330 s at most for the
# Python part), GPU_CHECK_BUDGET_S (min(320, that timeout - 30) s on a GPU: a bench measure
# starts only if what it needs is left), GPU_CHECK_BENCH_STEPS (12 per mode).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${OUT:-runs/gpu_check}"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
rm -f "$out"/gpu_check.json "$out"/gpu_check.out "$out"/gpu_check.stderr.log "$out"/pip.log "$out"/runs.tar.gz
if [[ -n "${GPU_CHECK_WORK:-}" ]]; then
  mkdir -p "$GPU_CHECK_WORK" || exit 2
  work="$(cd "$GPU_CHECK_WORK" && pwd)"
else
  work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")" || exit 2
  trap 'rm -rf "$work"' EXIT
fi
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ "${DRY_RUN:-0}" == 1 && -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
total_s="${GPU_CHECK_TOTAL_S:-360}"
mib=$((1024 * 1024))

fail_json() {  # the one JSON line, when gpu_check.py could not write its own (stdout and gpu_check.out)
  local partial="null"
  [[ -s "$out/gpu_check.json" ]] && partial="$(cat "$out/gpu_check.json")"
  printf '{"bench": "gpu_check", "ok": false, "error": "%s", "partial": %s}\n' "$1" "$partial" \
    | tee -a "$out/gpu_check.out"
}

cap_file() {  # cap_file FILE BYTES: keep its first quarter and last three quarters of BYTES
  local f="$1" max="$2" size
  [[ -f "$f" ]] || return 0
  size="$(stat -c %s "$f")"
  (( size > max )) || return 0
  { head -c $((max / 4)) "$f"; printf '\n[... gpu_check.sh cut %d bytes here ...]\n' $((size - max)); tail -c $((max * 3 / 4)) "$f"; } >"$f.cut" \
    && mv "$f.cut" "$f"
}

pack() {  # the run folders, reports and traces into $out/runs.tar.gz, under 15 MiB
  local tarball="$out/runs.tar.gz" limit=$((15 * mib))
  [[ -n "$(ls -A "$work")" ]] || return 0
  tar -czf "$tarball" -C "$work" . || echo "gpu_check: could not pack $work" >&2
  if [[ -f "$tarball" ]] && (( $(stat -c %s "$tarball") > limit )); then
    echo "gpu_check: runs.tar.gz over 15 MiB with the traces: packed without them" >&2
    tar -czf "$tarball" -C "$work" --exclude='*.trace.json' . || echo "gpu_check: could not pack $work" >&2
  fi
  if [[ -f "$tarball" ]] && (( $(stat -c %s "$tarball") > limit )); then
    echo "gpu_check: runs.tar.gz still over 15 MiB: left out" >&2
    rm -f "$tarball"
  fi
}

finish() {  # finish STATUS: pack, cap what comes back, exit
  pack
  cap_file "$out/gpu_check.stderr.log" $((8 * mib))
  cap_file "$out/gpu_check.out" $((4 * mib))
  cap_file "$out/pip.log" $((1 * mib))
  exit "$1"
}

# What this python lacks of dflash's requirements, as distributions (torch and transformers
# must be there). pydantic's own requirements are listed too: the wheels install with --no-deps.
missing="$("$PY" - <<'EOF'
import importlib.util
need = {"torch": "torch", "transformers": "transformers", "click": "click", "structlog": "structlog",
        "safetensors": "safetensors", "tokenizers": "tokenizers", "pydantic": "pydantic",
        "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
        "typing_inspection": "typing-inspection", "typing_extensions": "typing-extensions", "tomli_w": "tomli-w"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
EOF
)" || { echo "gpu_check: cannot run $PY" >&2; fail_json "cannot run $PY"; finish 2; }
if [[ " $missing " == *" torch "* || " $missing " == *" transformers "* ]]; then
  echo "gpu_check: $PY has no torch or transformers (missing: $missing); set PYTHON=" >&2
  fail_json "no torch or transformers in $PY"
  finish 2
fi
if [[ -n "$missing" ]]; then
  echo "INFO gpu_check installing from wheels/: $missing" | tee -a "$out/gpu_check.out"
  if [[ ! -d wheels ]]; then
    echo "gpu_check: $PY lacks $missing and there is no wheels/ folder (make gpu-wheels, then carry wheels/)" >&2
    fail_json "missing $missing and no wheels/"
    finish 2
  fi
  pip_args=(install --no-deps --no-index --find-links wheels/ --disable-pip-version-check)
  # shellcheck disable=SC2086  # one word per distribution
  if ! "$PY" -m pip "${pip_args[@]}" $missing >"$out/pip.log" 2>&1; then
    # An externally managed or read-only python: install beside it. gpu_check.py puts this
    # folder after the python's own packages, so nothing it has is shadowed.
    export GPU_CHECK_SITE="$PWD/wheels/site"
    # shellcheck disable=SC2086
    if ! "$PY" -m pip "${pip_args[@]}" --target "$GPU_CHECK_SITE" $missing >>"$out/pip.log" 2>&1; then
      # No pip at all: a wheel is a zip of what goes into site-packages.
      echo "gpu_check: pip failed twice; unpacking the wheels into $GPU_CHECK_SITE" >>"$out/pip.log"
      # shellcheck disable=SC2086
      if ! "$PY" - "$GPU_CHECK_SITE" $missing >>"$out/pip.log" 2>&1 <<'EOF'
import pathlib, re, sys, zipfile
site, wanted = pathlib.Path(sys.argv[1]), {re.sub(r"[-_.]+", "_", d).lower() for d in sys.argv[2:]}
found = {w.name.split("-")[0].lower(): w for w in pathlib.Path("wheels").glob("*.whl")}
lacking = sorted(wanted - found.keys())
if lacking:
    sys.exit(f"no wheel in wheels/ for {lacking}")
for name in sorted(wanted):
    zipfile.ZipFile(found[name]).extractall(site)
    print("unpacked", found[name].name)
EOF
      then
        echo "gpu_check: install from wheels/ failed (see $out/pip.log)" >&2
        tail -n 5 "$out/pip.log" >&2
        fail_json "install from wheels/ failed"
        finish 2
      fi
    fi
  fi
fi

if ! err="$("$PY" -c 'import os, sys
if os.environ.get("GPU_CHECK_SITE"): sys.path.append(os.environ["GPU_CHECK_SITE"])
import dflash.pipeline.coordinator, dflash.train.build' 2>&1)"; then
  echo "gpu_check: dflash does not import with $PY: $(tail -n 1 <<<"$err")" >&2
  fail_json "dflash does not import with $PY (see stderr)"
  finish 2
fi

# What is left of the whole script's time, less 10 s of kill grace and 15 s of packing.
timeout_s="${GPU_CHECK_TIMEOUT_S:-330}"
left=$((total_s - SECONDS - 25))
(( left < 30 )) && left=30
(( timeout_s > left )) && timeout_s=$left
if [[ -z "${GPU_CHECK_BUDGET_S:-}" && "${DRY_RUN:-0}" != 1 ]]; then
  budget=$((timeout_s - 30))
  (( budget > 320 )) && budget=320
  export GPU_CHECK_BUDGET_S="$budget"
fi
timeout -k 10 "$timeout_s" "$PY" bench/gpu_check.py --out "$out" --work "$work" \
  2>"$out/gpu_check.stderr.log" | tee -a "$out/gpu_check.out"
rc=$?
last="$(tail -n 1 "$out/gpu_check.out")"
if [[ "$last" != '{"bench": "gpu_check"'* ]]; then
  echo "gpu_check: bench/gpu_check.py ended with status $rc before its JSON line; last of its stderr:" >&2
  tail -n 30 "$out/gpu_check.stderr.log" >&2
  fail_json "gpu_check.py ended with status $rc (124: timed out after $timeout_s s)"
  finish $((rc ? rc : 1))
fi
if [[ "$rc" == 0 && "$last" != *'"ok": true'* ]]; then
  rc=1
fi
finish "$rc"
