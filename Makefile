# The two commands a new user needs: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Where pip finds no local CPU build of torch (plain PyPI serves the CUDA one for
# torch==2.13.0 on Linux), e.g.: make test TORCH_PIP_ARGS="--extra-index-url
# https://download.pytorch.org/whl/cpu" (2.13.0+cpu then wins over 2.13.0).
TORCH_PIP_ARGS ?=

.PHONY: demo test lint types pytest setup line-budget clean bench-cascade \
	bench-policies test-deep

include mk/vllm.mk

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch: a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtier demo

test: $(STAMP) lint types line-budget pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

types: $(STAMP)
	$(BIN)/mypy

line-budget:
	$(PYTHON) scripts/check_line_budget.py src tests benchmarks scripts

# The tests run one torch thread each (tests/conftest.py), so pytest runs one process per
# core (at most PYTEST_WORKERS); PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= 4
PYTEST_ARGS := $(if $(filter 0,$(PYTEST_WORKERS)),,-n auto --maxprocesses $(PYTEST_WORKERS))

pytest: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_ARGS)

# The property tests (those drawing examples with hypothesis) with EXAMPLES_SCALE times
# their examples (KVTIER_EXAMPLES_SCALE, read by tests/example_counts.py): a hunt for rare
# cases, not a CI step. A failing example found here goes into its test as an @example.
# The adapters' property tests run in test-vllm-deep.
EXAMPLES_SCALE ?= 10
# Each test may take EXAMPLES_SCALE times its usual time limit (pyproject: 300 s).
DEEP_TIMEOUT = --timeout $$((300 * $(EXAMPLES_SCALE)))
PROPERTY_TESTS = $(shell grep -rlE --include='test_*.py' 'scaled_examples|explore.engine' tests)

test-deep: $(STAMP)
	KVTIER_EXAMPLES_SCALE=$(EXAMPLES_SCALE) $(BIN)/pytest -q $(PYTEST_ARGS) $(DEEP_TIMEOUT) \
		$(filter-out tests/adapters/%,$(PROPERTY_TESTS))

# CPU-only vs DISK-only vs the CPU -> DISK cascade at equal bytes (trace replay, ~1 min
# on 2 cores; BENCH_ARGS=--json PATH).
bench-cascade: $(STAMP)
	$(BIN)/python benchmarks/bench_cascade.py $(BENCH_ARGS)

# Each tier policy's µs per operation and bytes per cached block, against LRU, at 20k and
# 200k blocks (~1.5 min on 2 busy cores; BENCH_ARGS=--quick, --json PATH).
bench-policies: $(STAMP)
	$(BIN)/python benchmarks/bench_policies.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist src/*.egg-info .mypy_cache .pytest_cache .ruff_cache
