# vLLM adapter tests in their own venv (`make test-vllm`); included by the root Makefile.
#
# vLLM's wheel metadata pins a CUDA torch, so pip must never resolve its dependencies:
# the CPU torch goes in first, then the pure-Python packages vLLM's scheduler path
# imports, kvtier's own missing dependencies, vLLM itself and kvtier, all --no-deps.
VLLM_PYTHON ?= python3.11
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQS := mk/vllm-requirements-cpu.txt mk/vllm-requirements-kvtier.txt
VLLM_ENV := VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
VLLM_PIP := $(VLLM_BIN)/pip install -q --no-deps -c $(VLLM_VENV)/pin.txt

.PHONY: test-vllm setup-vllm bench-vllm test-vllm-deep

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_REQS) pyproject.toml
	test -x $(VLLM_BIN)/python || $(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	echo torch==2.13.0 > $(VLLM_VENV)/pin.txt
	$(VLLM_PIP) $(addprefix -r ,$(VLLM_REQS))
	$(VLLM_PIP) vllm==0.33.0
	$(VLLM_PIP) -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_ENV) timeout 1200 $(VLLM_BIN)/python -m pytest -q $(PYTEST_ARGS) tests/adapters

# The adapters' property tests with EXAMPLES_SCALE times their examples (see test-deep).
test-vllm-deep: $(VLLM_STAMP)
	$(VLLM_ENV) KVTIER_EXAMPLES_SCALE=$(EXAMPLES_SCALE) $(VLLM_BIN)/python -m pytest -q \
		$(PYTEST_ARGS) $(DEEP_TIMEOUT) $(filter tests/adapters/%,$(PROPERTY_TESTS))

# kvtier's connector vs vLLM's SimpleCPUOffloadConnector, scheduler side (BENCH_ARGS=--quick).
bench-vllm: $(VLLM_STAMP)
	$(VLLM_ENV) timeout 1800 $(VLLM_BIN)/python benchmarks/bench_scheduler.py --vllm $(BENCH_ARGS)
