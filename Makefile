# Quick start:  make demo   |   make test
PYTHON ?= python3
# A CPU build of torch; bring your own torch to skip this (any torch>=2.2 is used as is).
TORCH_SPEC ?= torch==2.13.0
# Streams that split themselves by rank, tested for real. Installed without their declared dependencies
# (the test extra lists what they import): both ask for torchvision, whose PyPI build needs torch's CUDA
# libraries and, broken beside a CPU torch, breaks `import lightning`; streaming also asks for
# transformers<5 (and so a huggingface-hub that datasets 5 refuses) and numpy<2.2.
STREAM_LIBRARIES ?= litdata==0.2.76 mosaicml-streaming==0.13.0
INTEGRATIONS := $(patsubst %/pyproject.toml,%,$(wildcard integrations/*/pyproject.toml))
# What is installed, once per interpreter: a stamp is remade only when the requirements it installs change
# (`rm -r .make` or `make -B install` installs again).
STAMPS := .make/$(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])")

.PHONY: install install-core demo test test-fast docs serve-docs lint gpu-check

install: $(STAMPS)/all  ## everything the tests, the linters and the docs need
install-core: $(STAMPS)/core  ## torch (a CPU build if none is installed) and shardplug with numpy: what the demo needs

$(STAMPS)/core: pyproject.toml
	@mkdir -p $(STAMPS)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYTHON) -m pip install --quiet -e .
	@touch $@

$(STAMPS)/all: $(STAMPS)/core pyproject.toml $(wildcard integrations/*/pyproject.toml) Makefile
	$(PYTHON) -m pip install --quiet -e ".[test,stateful,lint,docs]" $(foreach d,$(INTEGRATIONS),-e $(d))
	$(PYTHON) -m pip install --quiet --no-deps $(STREAM_LIBRARIES)
	@touch $@

demo: install-core
	$(PYTHON) examples/demo.py

# pytest-xdist processes running the suite; a test module's tests run in one of them (its module-scoped runs once)
TEST_WORKERS ?= 2

test: install  # the whole suite: what CI runs
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

test-fast: install  # the inner loop: every test that starts no process (no process group, no program)
	SHARDPLUG_TESTS=fast $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

gpu-check: install  # on a CUDA machine: tests/gpu/ whole, then benchmarks/gpu.py (both say so and pass without CUDA)
	$(PYTHON) -m pytest -q -p no:randomly tests/gpu && $(PYTHON) benchmarks/gpu.py

lint: install  # ruff (lint, format) and mypy, with the versions of the lint extra
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

docs: install  # the documentation site (the docs extra), strictly
	PYTHONPATH=.:integrations/lightning:integrations/ignite $(PYTHON) -m mkdocs build --strict

serve-docs: install
	PYTHONPATH=.:integrations/lightning:integrations/ignite $(PYTHON) -m mkdocs serve
