# Quick start:  make demo   |   make test
PYTHON ?= python3
# A CPU build of torch; bring your own torch to skip this (any torch>=2.2 is used as is).
TORCH_SPEC ?= torch==2.13.0
INTEGRATIONS := $(patsubst %/pyproject.toml,%,$(wildcard integrations/*/pyproject.toml))

.PHONY: install demo test bench docs serve-docs

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYTHON) -m pip install --quiet -e ".[test,stateful]" $(foreach d,$(INTEGRATIONS),-e $(d))

demo: install
	$(PYTHON) examples/demo.py

test: install
	$(PYTHON) -m pytest -q

# The documentation site (needs the docs extra: pip install -e ".[docs]")
docs:
	PYTHONPATH=.:integrations/lightning:integrations/ignite $(PYTHON) -m mkdocs build --strict

serve-docs:
	PYTHONPATH=.:integrations/lightning:integrations/ignite $(PYTHON) -m mkdocs serve
