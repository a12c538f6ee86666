# The two commands of the README, each setting up what it needs first (docs/install.md):
#
#   make run     # the main job: the built-in sandbox preset, 3 simulated clients, 8 rounds of FedTOPS
#   make test    # the test suite (every core)
#
# Both create .venv when it is missing and install this project into it for the host's kind
# (HOST=auto: gpu when nvidia-smi lists a GPU, else cpu; or cpu, gpu, gpu-vllm, cpu-vllm), again only
# when pyproject.toml or the install scripts changed since. `make lint` runs ruff as CI does.

PYTHON ?= python3
HOST ?= auto
VENV ?= .venv
STAMP := $(VENV)/.fedtops-installed-$(HOST)
INSTALL_INPUTS := pyproject.toml scripts/install.sh scripts/envcheck.py $(wildcard scripts/vllm-*.txt)

.PHONY: run test lint install

run: $(STAMP)
	FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 $(VENV)/bin/flwr run . --stream --federation-config "num-supernodes=3"

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/python -m ruff check .
	$(VENV)/bin/python -m ruff format --check .

install: $(STAMP)

$(STAMP): $(INSTALL_INPUTS)
	@$(PYTHON) -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 14) else "$(PYTHON) is Python %d.%d; this project needs 3.11 to 3.13: make PYTHON=python3.12 ..." % sys.version_info[:2])'
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.fedtops-installed-*
	PYTHON=$(VENV)/bin/python scripts/install.sh $(HOST)
	touch $@
