# `make demo` and `make test` each set everything up on a fresh machine, then run.
VENV  := .venv
BIN   := $(VENV)/bin
SETUP := scripts/setup.sh

.PHONY: demo test bench lab setup setup-test setup-notebook clean-venv

$(VENV)/.setup-base: pyproject.toml $(SETUP)
	bash $(SETUP)
	touch $@

# the test extra holds every notebook package (tests/test_setup.py checks), so it stamps the notebook setup too:
# `make lab` after `make test` must not install again
$(VENV)/.setup-test: pyproject.toml $(SETUP)
	bash $(SETUP) test
	touch $@ $(VENV)/.setup-base $(VENV)/.setup-notebook

$(VENV)/.setup-notebook: pyproject.toml $(SETUP)
	bash $(SETUP) notebook
	touch $@ $(VENV)/.setup-base

setup: $(VENV)/.setup-base
setup-test: $(VENV)/.setup-test
setup-notebook: $(VENV)/.setup-notebook

demo: setup
	$(BIN)/edgeprobe demo

test: setup-test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

# JupyterLab on loopback only; it prints the URL with its access token.
lab: setup-notebook
	$(BIN)/jupyter lab --ip 127.0.0.1 --no-browser --notebook-dir notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

bench: setup
	$(BIN)/python bench/forward.py
	$(BIN)/python bench/profile.py
	$(BIN)/python bench/quant.py
	$(BIN)/python bench/agent.py
	$(BIN)/python bench/schedule.py
	$(BIN)/python bench/decode.py

clean-venv:
	rm -rf $(VENV)
