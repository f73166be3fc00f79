# Two commands for a fresh machine with Python 3.10+:
#   make demo   generate the default project, install it, train its default experiment
#   make test       the template's tests and three baked projects' lint, types and fast tests
#   make test-all   the same and the default project's slow tests (what CI runs)
PYTHON ?= python3
# torch is installed first, as a CPU wheel where there is no NVIDIA driver: the version that the
# generated project's `make install` pins (its Makefile's TORCH, torch==2.13.0), read from there.
TORCH ?= $(shell sed -n 's/^TORCH ?= //p' "{{cookiecutter.project_slug}}/Makefile")
VENV := .venv
DEMO := build/demo

.PHONY: demo test test-all test-fast lint clean

$(VENV)/.installed: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python "{{cookiecutter.project_slug}}/scripts/install_torch.py" "$(TORCH)"
	$(VENV)/bin/python -m pip install -r requirements-dev.txt
	touch $@

demo:
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(PYTHON) -m venv $(DEMO)/.venv
	$(DEMO)/.venv/bin/python "{{cookiecutter.project_slug}}/scripts/install_torch.py" "$(TORCH)"
	$(DEMO)/.venv/bin/python -m pip install "cookiecutter==2.7.1"
	$(DEMO)/.venv/bin/cookiecutter --no-input --output-dir $(DEMO) .
	$(DEMO)/.venv/bin/python -m pip install -e $(DEMO)/lightning-hydra-project
	cd $(DEMO)/lightning-hydra-project && ../.venv/bin/lightning_hydra_project-train extras.print_config=false

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -m "not project_slow"

test-all: $(VENV)/.installed
	$(VENV)/bin/python -m pytest

test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -m "not slow"

lint: $(VENV)/.installed
	$(VENV)/bin/python -m ruff check hooks tests local_extensions.py
	$(VENV)/bin/python -m ruff format --check hooks tests local_extensions.py

clean:
	rm -rf $(VENV) build .pytest_cache
