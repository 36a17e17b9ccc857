# The two commands of the README: `make demo` and `make test` (the suite, then the docs site
# built with --strict: a broken link, anchor or page fails).
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
	$(BIN)/python -m pip install -q -e ".[test,plot,tb,docs]"
	touch $@

demo: setup
	$(BIN)/hybridtrain finetune -c examples/squad_tiny.yaml
	@echo
	@echo "Next: the command is $(BIN)/hybridtrain (or run 'source $(BIN)/activate' first), e.g."
	@echo "  $(BIN)/hybridtrain evaluate -c examples/squad_tiny.yaml"
	@echo "  $(BIN)/hybridtrain generate --model outputs/squad_tiny --prompt 'Context: ... Question: ... Answer:'"
	@echo "  $(BIN)/hybridtrain finetune -c examples/chat_lora_tiny.yaml"

test: setup
	$(BIN)/python -m pip install -q --no-deps -e tests/families/hybridtrain_dense
	$(BIN)/python -m pytest -q tests
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

clean:
	rm -rf $(VENV) outputs .pytest_cache
