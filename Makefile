# fedge: two commands on a fresh machine — `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export FLWR_TELEMETRY_ENABLED := 0
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1

.PHONY: demo test install lint format mosquitto clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q -c constraints.txt -e '.[simulation,broker,dev]'
	$(BIN)/pip check
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/fedge simulate --out runs/demo

mosquitto:
	@command -v mosquitto >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients; }

lint: install
	$(BIN)/ruff check fedge tests bench
	$(BIN)/ruff format --check fedge tests bench

format: install
	$(BIN)/ruff format fedge tests bench
	$(BIN)/ruff check --fix fedge tests bench

test: install mosquitto lint
	$(BIN)/pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
