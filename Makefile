# The two commands of the README, each setting up what it needs first (docs/install.md):
#
#   make run     # the main job: the built-in sandbox preset, 3 simulated clients, 8 rounds of FedTOPS
#   make test    # the test suite (every core)
#
# Both create .venv when it is missing and install this project into it for the host's kind
# (HOST=auto: the kind .venv was installed for, else gpu when nvidia-smi lists a GPU, else cpu; or
# cpu, gpu, gpu-vllm, cpu-vllm), again only when pyproject.toml or the install scripts changed since.
# `make run` exits non-zero when the run did not complete (flwr run itself exits 0 then).
# `make lint` runs ruff as CI does; `make stop` stops the local SuperLink that `flwr run .` started
# from .venv (server_app/local_superlink.py), and only that one.

PYTHON ?= python3
HOST ?= auto
VENV ?= .venv
STAMP := $(VENV)/.fedtops-installed-$(HOST)
INSTALL_INPUTS := pyproject.toml scripts/install.sh scripts/envcheck.py $(wildcard scripts/vllm-*.txt)
# flwr starts `flower-superlink` from PATH, and the local SuperLink reads the install setting.
IN_VENV := PATH="$(abspath $(VENV))/bin:$$PATH" FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

.PHONY: run test lint install stop

run: $(STAMP)
	$(IN_VENV) $(VENV)/bin/python -m server_app.run_status run . --stream --federation-config "num-supernodes=3"

test: $(STAMP)
	$(IN_VENV) $(VENV)/bin/python -m pytest -q

stop:  # the local SuperLink that `flwr run .` started from .venv, and what runs under it (starts nothing)
	$(VENV)/bin/python -m server_app.local_superlink stop

lint: $(STAMP)
	$(VENV)/bin/python -m ruff check .
	$(VENV)/bin/python -m ruff format --check .

install: $(STAMP)

$(STAMP): $(INSTALL_INPUTS)
	@test -x $(VENV)/bin/python || $(PYTHON) -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 14) else "$(PYTHON) is Python %d.%d; this project needs 3.11 to 3.13: make PYTHON=python3.12 ..." % sys.version_info[:2])'
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	PYTHON=$(VENV)/bin/python scripts/install.sh $(HOST)
	touch $@
