#!/usr/bin/env bash
# Before spending a GPU lease on bench/gpu_check.sh: every check that can run on a CPU. Prints
# one line per check ("ok <check>: ..." or "MISSING <check>: ..."), then READY (exit 0) or
# "NOT READY: <the checks that are missing>" (exit 1).
#   wheels    wheels/ (make gpu-wheels) holds exactly the distributions the GPU machine's python
#             lacks (GPU_WHEELS in the Makefile), at .venv's versions, and pip would install
#             every one of them on CPython 3.12 x86-64 (--dry-run --target, --only-binary=:all:,
#             the manylinux platforms of GPU_WHEEL_PLATFORMS, --no-index)
#   compat    make gpu-compat passed (runs/gpu_compat/result.json: the GPU machine's torch and
#             transformers in .venv-gpu, its tests and gpu_check's dry run), on the sources of
#             now (dflash, bench, configs, tests, setup.py: their fingerprint)
#   dry_run   DRY_RUN=1 bash bench/gpu_check.sh ends with "ok": true, and what it leaves in $OUT
#             fits what comes back from the GPU machine (at most 8 files, at most 2 folders
#             down, names of letters, digits, '.', '_', '-', 16 MiB each, 64 MiB in all)
#   travel    what travels to the GPU machine (git ls-files -co --exclude-standard, plus the
#             carried wheels/) is under 64 MiB
#
#   bash bench/gpu_ready.sh                  # all four
#   bash bench/gpu_ready.sh wheels           # one of them (make gpu-wheels runs this one)
# Used by the Makefile too:
#   bash bench/gpu_ready.sh run-compat PY TEST...   # what make gpu-compat runs under PY: the result
#   bash bench/gpu_ready.sh fingerprint             # the sources' fingerprint
# PYTHON: the interpreter with pip for the checks (default .venv/bin/python, else python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi
COMPAT_RESULT=runs/gpu_compat/result.json
MIB=$((1024 * 1024))

makefile_list() {  # the words of one Makefile variable (NAME := words), a single source of truth
  sed -n "s/^$1 *:\?= *//p" Makefile | head -n 1
}

fingerprint() {  # sha256 of the sources a compat run depends on (tracked and untracked, not ignored)
  git ls-files -co --exclude-standard -z -- dflash bench configs tests setup.py \
    | "$PY" -c 'import hashlib, os, sys
h = hashlib.sha256()
for p in sorted(set(sys.stdin.read().split("\0")) - {""}):
    if os.path.isfile(p):
        h.update(p.encode() + b"\0")
        with open(p, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
print(h.hexdigest()[:16])'
}

check_wheels() {
  local want platforms args=() p problems
  want="$(makefile_list GPU_WHEELS)"
  platforms="$(makefile_list GPU_WHEEL_PLATFORMS)"
  if [[ -z "$want" || -z "$platforms" ]]; then
    echo "MISSING wheels: no GPU_WHEELS or GPU_WHEEL_PLATFORMS in the Makefile"
    return 1
  fi
  if ! compgen -G "wheels/*.whl" >/dev/null; then
    echo "MISSING wheels: no wheels/*.whl (make gpu-wheels)"
    return 1
  fi
  # Names and versions: exactly GPU_WHEELS, one wheel each, at the versions .venv has.
  # shellcheck disable=SC2086  # one word per distribution
  problems="$("$PY" - $want <<'EOF'
import importlib.metadata as md, pathlib, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
want = {norm(d) for d in sys.argv[1:]}
found: dict[str, list[str]] = {}
for w in sorted(pathlib.Path("wheels").glob("*.whl")):
    name, version = w.name.split("-")[:2]
    found.setdefault(norm(name), []).append(version)
out = []
if want - found.keys():
    out.append(f"no wheel for {sorted(want - found.keys())}")
if found.keys() - want:
    out.append(f"wheels the GPU machine does not need: {sorted(found.keys() - want)}")
out += [f"{n}: {len(v)} wheels ({', '.join(v)})" for n, v in found.items() if len(v) > 1]
for n, versions in found.items():
    try:
        have = md.version(n)
    except md.PackageNotFoundError:
        continue  # no such distribution in this python: nothing to compare with
    if n in want and versions != [have]:
        out.append(f"{n} {versions[0]} in wheels/, {have} in {sys.executable}")
print("; ".join(out))
EOF
)" || { echo "MISSING wheels: cannot read wheels/ with $PY"; return 1; }
  if [[ -n "$problems" ]]; then
    echo "MISSING wheels: $problems (make gpu-wheels)"
    return 1
  fi
  # Tags: would pip install each on CPython 3.12, x86-64 manylinux? (--dry-run installs nothing)
  for p in $platforms; do args+=(--platform "$p"); done
  local log
  log="$(mktemp)"
  if ! PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --dry-run --ignore-installed --no-deps --no-index \
      --only-binary=:all: --implementation cp --python-version 3.12 --abi cp312 "${args[@]}" \
      --target "$log.target" --disable-pip-version-check wheels/*.whl >"$log" 2>&1; then
    echo "MISSING wheels: pip would not install them on cp312 x86-64: $(grep -m 1 ERROR "$log")"
    rm -rf "$log" "$log.target"
    return 1
  fi
  echo "ok wheels: $(grep -m 1 '^Would install' "$log" | sed 's/^Would install //') (cp312, x86-64 manylinux or pure)"
  rm -rf "$log" "$log.target"
}

check_compat() {
  if [[ ! -f "$COMPAT_RESULT" ]]; then
    echo "MISSING compat: no $COMPAT_RESULT (make gpu-compat)"
    return 1
  fi
  local now verdict
  now="$(fingerprint)"
  verdict="$("$PY" - "$COMPAT_RESULT" "$now" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
bad = []
if not r.get("ok"):
    bad.append(f"failed ({r.get('failed')})")
if r.get("fingerprint") != sys.argv[2]:
    bad.append(f"stale: the sources changed since {r.get('date')} (make gpu-compat again)")
v = r.get("versions", {})
seen = f"python {v.get('python')}, torch {v.get('torch')}, transformers {v.get('transformers')}"
tests = r.get("tests", {})
absent = f", not in the tree: {' '.join(tests['absent'])}" if tests.get("absent") else ""
ran = f"tests {tests.get('summary') or 'none'}{absent}; dry run {r.get('dry_run', {}).get('summary')}"
print(("MISSING compat: " + "; ".join(bad) + f" — {seen}") if bad else f"ok compat: {seen}; {ran}; {r.get('date')}")
EOF
)" || { echo "MISSING compat: cannot read $COMPAT_RESULT"; return 1; }
  echo "$verdict"
  [[ "$verdict" == ok* ]]
}

check_out_dir() {  # check_out_dir DIR: what would come back from the GPU machine
  "$PY" - "$1" <<'EOF'
import os, re, sys
root, bad, files, total = sys.argv[1], [], 0, 0
for d, dirs, names in os.walk(root):
    depth = os.path.relpath(d, root).count(os.sep) + (d != root)
    for n in dirs + names:
        p = os.path.join(d, n)
        if not re.fullmatch(r"[A-Za-z0-9._-]+", n):
            bad.append(f"odd name {p}")
        if os.path.islink(p):
            bad.append(f"a link {p}")
    for n in names:
        p = os.path.join(d, n)
        files, size = files + 1, os.path.getsize(p)
        total += size
        if depth > 2:
            bad.append(f"{p} more than 2 folders down")
        if size >= 16 * 2**20:
            bad.append(f"{p} is {size / 2**20:.1f} MiB")
if files > 8:
    bad.append(f"{files} files (at most 8)")
if total >= 64 * 2**20:
    bad.append(f"{total / 2**20:.1f} MiB in all")
listing = ", ".join(sorted(os.listdir(root)))
print(("; ".join(bad) + f" [{listing}]") if bad else f"{files} files, {total / 2**20:.2f} MiB: {listing}")
sys.exit(1 if bad else 0)
EOF
}

check_dry_run() {
  local out log last fit rc start=$SECONDS
  out="$(mktemp -d)"
  log="$(mktemp)"
  DRY_RUN=1 OUT="$out" bash bench/gpu_check.sh >"$log" 2>&1
  rc=$?
  last="$(tail -n 1 "$out/gpu_check.out" 2>/dev/null)"
  fit="$(check_out_dir "$out")"
  local fits=$?
  if [[ "$rc" != 0 || "$last" != '{"bench": "gpu_check"'*'"ok": true'* ]]; then
    echo "MISSING dry_run: DRY_RUN=1 bench/gpu_check.sh ended with status $rc; $(grep -E '^(FAIL|gpu_check:)' "$log" | head -n 3 | tr '\n' ' ')"
    rm -rf "$out" "$log"
    return 1
  fi
  if [[ "$fits" != 0 ]]; then
    echo "MISSING dry_run: its \$OUT would not come back whole: $fit"
    rm -rf "$out" "$log"
    return 1
  fi
  echo "ok dry_run: ok true in $((SECONDS - start)) s; \$OUT: $fit"
  rm -rf "$out" "$log"
}

check_travel() {
  local size
  size="$( { git ls-files -co --exclude-standard -z; if [[ -d wheels ]]; then find wheels -type f -print0; fi; } \
    | "$PY" -c 'import os, sys
print(sum(os.path.getsize(p) for p in set(sys.stdin.read().split("\0")) - {""} if os.path.isfile(p)))')" \
    || { echo "MISSING travel: cannot list the working tree"; return 1; }
  if (( size >= 64 * MIB )); then
    echo "MISSING travel: the working tree and wheels/ come to $((size / MIB)) MiB (at most 64)"
    return 1
  fi
  echo "ok travel: $(( (size * 10 / MIB) / 10 )).$(( (size * 10 / MIB) % 10 )) MiB with wheels/ (at most 64)"
}

run_compat() {  # run_compat PY TEST...: the tests that exist, then the dry run, under PY; the result file
  local py="$1" start=$SECONDS t tests=() absent=() tests_rc=0 dry_rc dir
  shift
  dir="$(dirname "$COMPAT_RESULT")"
  rm -rf "$dir" && mkdir -p "$dir" || return 2
  for t in "$@"; do
    if [[ -f "$t" ]]; then tests+=("$t"); else absent+=("$t"); fi
  done
  if (( ${#absent[@]} )); then
    echo "gpu-compat: NOTE: not in the tree, skipped: ${absent[*]}"
  fi
  if (( ${#tests[@]} )); then
    echo "gpu-compat: $py -m pytest -q ${tests[*]}"
    "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" >"$dir/pytest.log" 2>&1
    tests_rc=$?
    tail -n 3 "$dir/pytest.log"
  fi
  echo "gpu-compat: DRY_RUN=1 PYTHON=$py bash bench/gpu_check.sh"
  DRY_RUN=1 PYTHON="$py" OUT="$dir/gpu_check" bash bench/gpu_check.sh >"$dir/gpu_check.log" 2>&1
  dry_rc=$?
  grep -E '^(PASS|FAIL|SKIP|MEASURE|gpu_check:)' "$dir/gpu_check.log" | cut -c 1-160
  "$py" - "$COMPAT_RESULT" "$tests_rc" "$dry_rc" "$((SECONDS - start))" "$(fingerprint)" \
    "${tests[*]:-}" "${absent[*]:-}" <<'EOF'
import datetime, importlib.metadata as md, json, pathlib, platform, re, subprocess, sys
path, tests_rc, dry_rc, wall, fp, ran, absent = sys.argv[1:8]
d = pathlib.Path(path).parent
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
def torch_build():  # e.g. 2.11.0+cu130: PyPI's CUDA build, running on this CPU
    try:
        import torch
        return f"{torch.__version__}, CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()}"
    except Exception as err:
        return f"no torch: {err}"
summary = None
if ran and (d / "pytest.log").exists():
    lines = [x for x in (d / "pytest.log").read_text().splitlines() if re.search(r"\d+ (passed|failed|error)", x)]
    summary = lines[-1].strip("= ") if lines else f"exit {tests_rc}"
last = {}
try:
    last = json.loads((d / "gpu_check" / "gpu_check.out").read_text().splitlines()[-1])
except Exception:
    pass
failed = ([] if int(tests_rc) == 0 else ["tests"]) + ([] if int(dry_rc) == 0 and last.get("ok") else ["dry_run"])
res = {
    "ok": not failed, "failed": failed,
    "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "fingerprint": fp, "wall_s": int(wall),
    "versions": {"python": platform.python_version(), **{n: version(n) for n in
                 ("torch", "transformers", "tokenizers", "safetensors", "pydantic", "structlog")},
                 "torch_build": torch_build()},
    "tests": {"ran": ran.split(), "absent": absent.split(), "exit": int(tests_rc), "summary": summary},
    "dry_run": {"exit": int(dry_rc), "ok": last.get("ok"), "failed": last.get("failed"),
                "elapsed_s": last.get("elapsed_s"),
                "summary": f"ok {last.get('ok')}, {last.get('elapsed_s')} s, failed {last.get('failed')}"},
}
pathlib.Path(path).write_text(json.dumps(res, indent=1) + "\n")
print(f"gpu-compat: {'PASSED' if res['ok'] else 'FAILED ' + ' '.join(failed)} in {wall} s "
      f"(python {res['versions']['python']}, torch {res['versions']['torch']}, "
      f"transformers {res['versions']['transformers']}); {path}")
sys.exit(0 if res["ok"] else 1)
EOF
}

case "${1:-all}" in
  fingerprint) fingerprint; exit ;;
  run-compat) shift; [[ $# -ge 1 ]] || { echo "usage: $0 run-compat PY [TEST...]" >&2; exit 2; }; run_compat "$@"; exit ;;
  all) checks=(wheels compat dry_run travel) ;;
  wheels | compat | dry_run | travel) checks=("$1") ;;
  *) echo "usage: $0 [wheels|compat|dry_run|travel|fingerprint|run-compat PY TEST...]" >&2; exit 2 ;;
esac
missing=()
for c in "${checks[@]}"; do
  "check_$c" || missing+=("$c")
done
if (( ${#missing[@]} )); then
  echo "NOT READY: ${missing[*]}"
  exit 1
fi
echo "READY"
