# fedge: two commands on a fresh machine — `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
AMQTT_VERSION := 0.11.4
export FLWR_TELEMETRY_ENABLED := 0
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1

.PHONY: demo test test-load install lint format mosquitto clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# amqtt (the embedded broker) pins typer==0.15.4 for its own scripts; Flower's CLI needs typer>=0.19.
# amqtt goes in without its dependencies (the `broker` extra lists the rest) and pip check may report only that.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q -c constraints.txt -e '.[simulation,broker,onnx,dev]'
	$(BIN)/pip install -q --no-deps amqtt==$(AMQTT_VERSION)
	$(BIN)/pip check | grep -v "^amqtt $(AMQTT_VERSION) .*typer" | grep . && exit 1 || true
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/fedge simulate --out runs/demo

mosquitto:
	@command -v mosquitto >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients; }

lint: install
	$(BIN)/ruff check fedge tests examples
	$(BIN)/ruff format --check fedge tests examples

format: install
	$(BIN)/ruff format fedge tests examples
	$(BIN)/ruff check --fix fedge tests examples

test: install mosquitto lint
	$(BIN)/pytest -q -p no:cacheprovider

# The service and fleet tests with two busy-loop processes beside them, three times in a row.
test-load: install mosquitto
	$(BIN)/python tests/run_under_load.py --busy 2 --repeat 3 tests/service

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
