# The two commands of the README. Both bootstrap .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint types unit test-unit bench clean prometheus prometheus-install postgres test-clients

$(STAMP): pyproject.toml
	@echo "bootstrapping $(VENV) (first run installs the project and its test tools)..."
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	@$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,plots]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/loopwarden serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check budget middleware tests bench dashboards scripts
	$(BIN)/ruff format --check budget middleware tests bench dashboards

types: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy --strict dashboards

# A local Prometheus scraping the running gateway (`make run`), alert rules loaded; foreground.
prometheus:
	bash scripts/run-prometheus.sh

prometheus-install:
	bash scripts/ensure-prometheus.sh

postgres:
	bash scripts/ensure-postgres.sh

unit: $(STAMP) prometheus-install postgres
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test: lint types unit

# The fast tier alone: no server, no PostgreSQL, no Prometheus (tests/unit/).
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

# Opt-in, not part of `make test`: real clients installed with npm (the Codex CLI), end to end.
test-clients: $(STAMP)
	@command -v codex >/dev/null || npm install -g @openai/codex
	LOOPWARDEN_CLIENT_TESTS=1 $(BIN)/python -m pytest -q -m clients tests/e2e/test_codex.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/ledger.py

clean:
	rm -rf .prometheus $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
