# The two commands of the README: `make demo` and `make test`.
# Both create .venv (seeing system site-packages, so a cluster's CUDA torch is reused) and
# install the pinned CPU torch only when no torch is importable.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test,plot,tb]"
	touch $@

demo: setup
	$(BIN)/hybridtrain finetune -c examples/squad_tiny.yaml

test: setup
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) outputs .pytest_cache
