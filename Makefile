# `make demo` and `make test` each set everything up on a fresh machine, then run.
VENV  := .venv
BIN   := $(VENV)/bin
SETUP := scripts/setup.sh
# the emulated arm64 device (scripts/arm64_python.sh); rebuilt by `make test` if its cache was removed
ARM64 := $(or $(EDGEPROBE_ARM64),$(or $(EDGEPROBE_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/edgeprobe)/arm64)

.PHONY: demo test bench lab notebooks setup setup-test setup-notebook setup-ray setup-arm64 clean-venv

$(VENV)/.setup-base: pyproject.toml $(SETUP) scripts/arm64_python.sh
	bash $(SETUP)
	touch $@

# the test extra holds every notebook and ray package (tests/test_setup.py checks), so it stamps those setups too:
# `make lab` or `make bench` after `make test` must not install again
$(VENV)/.setup-test: pyproject.toml $(SETUP) scripts/arm64_python.sh
	bash $(SETUP) test
	touch $@ $(VENV)/.setup-base $(VENV)/.setup-notebook $(VENV)/.setup-ray

$(VENV)/.setup-notebook: pyproject.toml $(SETUP) scripts/arm64_python.sh
	bash $(SETUP) notebook
	touch $@ $(VENV)/.setup-base

# Ray for `edgeprobe profile ... --ray` and bench/profile_ray.py
$(VENV)/.setup-ray: pyproject.toml $(SETUP) scripts/arm64_python.sh
	bash $(SETUP) ray
	touch $@ $(VENV)/.setup-base

setup: $(VENV)/.setup-base
setup-test: $(VENV)/.setup-test
setup-notebook: $(VENV)/.setup-notebook
setup-ray: $(VENV)/.setup-ray
# the emulated phone (`--device arm64`): built by demo and test, or alone
setup-arm64: $(ARM64)/bin/python3

demo: setup $(ARM64)/bin/python3
	$(BIN)/edgeprobe demo

$(ARM64)/bin/python3:
	bash scripts/arm64_python.sh $(ARM64)

# lint first: a style or pyflakes finding fails in seconds, before the 20-minute suite
# prepared models of other source versions are never read again (their key holds the code's hash) and take ~1 GB
# each: pruned first, so that editing the quantizer or kernels between runs does not fill the disk
# the suite runs shuffled (pytest-randomly: modules, then the tests inside each) in the order TEST_SEED gives, the same
# on every machine: no test may lean on another's leftovers; `make test TEST_SEED=N` tries another order
TEST_SEED ?= 1
test: setup-test $(ARM64)/bin/python3
	$(BIN)/ruff check .
	$(BIN)/edgeprobe cache prune
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=30 -p randomly --randomly-seed=$(TEST_SEED) tests

# the notebooks' .ipynb from their jupytext sources (notebooks/*.py) after an edit outside JupyterLab
notebooks: setup-notebook
	$(BIN)/jupytext --update --to ipynb notebooks/0*.py

# JupyterLab on loopback only; it prints the URL with its access token.
lab: setup-notebook
	$(BIN)/jupyter lab --ip 127.0.0.1 --no-browser --notebook-dir notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

bench: setup setup-ray
	$(BIN)/python bench/forward.py
	$(BIN)/python bench/profile.py
	$(BIN)/python bench/profile_ray.py
	$(BIN)/python bench/quant.py
	$(BIN)/python bench/agent.py
	$(BIN)/python bench/schedule.py
	$(BIN)/python bench/decode.py

clean-venv:
	rm -rf $(VENV)
