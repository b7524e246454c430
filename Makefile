# `make demo` and `make test` each set everything up on a fresh machine, then run.
VENV  := .venv
BIN   := $(VENV)/bin
SETUP := scripts/setup.sh

.PHONY: demo test bench setup setup-test clean-venv

$(VENV)/.setup-base: pyproject.toml $(SETUP)
	bash $(SETUP)
	touch $@

$(VENV)/.setup-test: pyproject.toml $(SETUP)
	bash $(SETUP) test
	touch $@ $(VENV)/.setup-base

setup: $(VENV)/.setup-base
setup-test: $(VENV)/.setup-test

demo: setup
	$(BIN)/edgeprobe demo

test: setup-test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python bench/forward.py
	$(BIN)/python bench/profile.py
	$(BIN)/python bench/quant.py
	$(BIN)/python bench/agent.py
	$(BIN)/python bench/schedule.py
	$(BIN)/python bench/decode.py

clean-venv:
	rm -rf $(VENV)
