# Two commands on a fresh machine (Python 3.11, no torch):
#   make demo   sets up .venv and runs the main job (tools/demo.py)
#   make test   sets up .venv and runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Where torch is missing, this one is installed (a CPU build on these machines).
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test setup
demo: setup
	$(PY) tools/demo.py $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml $(wildcard kernels/*.cpp kernels/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q setuptools wheel ninja numpy safetensors gguf pytest hypothesis triton
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $@
