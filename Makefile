# Two commands do all set-up on a fresh machine:
#   make demo   -- virtual environment + install + the demo (no download needed)
#   make test   -- virtual environment + every extra (`all`, then `pip check`) + the test suite
#   make dist   -- sdist and wheel in dist/, checked with `twine check --strict`
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# the exact CPU wheel first: an open torch range would pull several GB of CUDA packages
TORCH  ?= torch==2.13.0

.PHONY: demo test docs install install-dev install-cuda dist bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null

$(VENV)/.core: $(BIN)/python pyproject.toml
	$(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e .
	touch $@

# `all` holds every extra: installing them together, then `pip check`, shows they agree
$(VENV)/.dev: $(VENV)/.core
	$(BIN)/pip install -e ".[all]"
	$(BIN)/pip check
	touch $@

install: $(VENV)/.core
install-dev: $(VENV)/.dev

# On a machine with an NVIDIA GPU: the CUDA build of the same torch version from the PyTorch
# index instead of the CPU wheel (several GB), then protofl. CUDA names the index's CUDA
# version (cu126, cu128, ...: one the machine's driver supports, see pytorch.org).
# Then: protofl run cfg.yaml execution.device=cuda   (docs/gpu.md)
CUDA   ?= cu128
install-cuda: $(BIN)/python
	$(BIN)/pip install $(TORCH) --index-url https://download.pytorch.org/whl/$(CUDA)
	$(BIN)/pip install -e .
	$(BIN)/python -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))"
	touch $(VENV)/.core

demo: install
	$(BIN)/protofl demo

# the linter and the type checker first (ruff and mypy, configured in pyproject.toml: zero
# findings), then the suite in two parts: the in-process tests on two workers (pytest-xdist),
# then, one after another, the tests that start real Flower, Ray and pip processes (they
# time their processes)
test: install-dev
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/pytest -n 2 -m "not (flower or ray or soak or wheel)"
	$(BIN)/pytest -m "flower or ray or soak or wheel"

# the docs site into site/ (warnings are errors); the test suite builds it too and runs
# docs/tutorial.ipynb (tests/test_docs.py)
docs: install-dev
	$(BIN)/mkdocs build --strict

dist: install-dev
	rm -rf dist
	$(BIN)/python -m build --outdir dist
	$(BIN)/twine check --strict dist/*

clean:
	rm -rf $(VENV) runs site .pytest_cache .mypy_cache .ruff_cache dist build src/protofl.egg-info
