# The two commands of the README: `make demo` and `make test` (the suite, then the docs site
# built with --strict: a broken link, anchor or page fails).
# Both create .venv (seeing system site-packages, so a cluster's CUDA torch is reused) and
# install the pinned CPU torch only when no torch is importable.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0

# The GPU path's kernels, which the tests run on the CPU under Triton's interpreter
# (TRITON_INTERPRET=1): Triton, Liger-Kernel, and mamba_ssm without its CUDA extension
# (MAMBA_SKIP_CUDA_BUILD; FORCE_BUILD skips its prebuilt-wheel lookup; torch must be installed
# first). `make test` installs them once; a Triton or mamba_ssm already importable (a cluster's
# CUDA build) is kept. `make demo` does not need them.
TRITON_PIN ?= triton==3.7.1
KERNEL_PINS ?= liger-kernel==0.8.5 einops==0.8.2 packaging
MAMBA_PIN ?= mamba-ssm==2.3.2.post1
# QLoRA's NF4 base (peft.base_quant: nf4) and training.float8, the `quant` extra; it requires no torch of its own
TORCHAO_PIN ?= torchao==0.18.0
# The experiment trackers the suite runs offline (the wandb and mlflow extras; ~15 s to install)
TRACKER_PINS ?= wandb==0.31.0 mlflow-skinny==3.18.0 sqlalchemy==2.1.9 alembic==1.20.1
# lm-evaluation-harness (the lm_eval extra; ~40 packages with scikit-learn, nltk, sacrebleu:
# 25 s of CPU to install, 2026-12-06)
LM_EVAL_PIN ?= lm-eval==0.4.13

# The set-up's packages (torch and the rest: ~10,000 Python files) are installed without
# bytecode, then compiled on every core at once, as pip would compile them one at a time
# (errors ignored as pip ignores them: torch ships a file only Python 3.12 parses), all but
# what nothing here imports: packages' own test folders and transformers' other model families
# (~4,000 files; imported anyway, they would compile then). On the 2-core test machine the
# set-up took 75 s so, 88 s with pip compiling everything (2026-11-29).
PIP_UNCOMPILED := $(BIN)/python -m pip install -q --no-compile
COMPILE = $(BIN)/python -c "import compileall, re, sysconfig; \
  skip = re.compile(r'/tests/|/transformers/models/(?!auto/|nemotron_h/)'); \
  [compileall.compile_dir(d, quiet=2, workers=0, rx=skip) for d in {sysconfig.get_path('purelib'), sysconfig.get_path('platlib')}]"

.PHONY: setup test-deps demo test clean

setup: $(VENV)/.installed

# The test suite's own packages: those kernels, and the model family the tests install from
# outside the source tree (tests/families/hybridtrain_dense, found through its entry point).
test-deps: $(VENV)/.test-deps

$(VENV)/.test-deps: $(VENV)/.installed Makefile tests/families/hybridtrain_dense/pyproject.toml
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q "$(TRITON_PIN)"
	$(BIN)/python -m pip install -q $(KERNEL_PINS) $(TRACKER_PINS) $(LM_EVAL_PIN) "$(TORCHAO_PIN)" "$(TORCH_PIN)"
	$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('mamba_ssm') is None)" || \
	  MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE $(BIN)/python -m pip install -q --no-deps \
	    --no-build-isolation "$(MAMBA_PIN)"
	$(BIN)/python -m pip install -q --no-deps -e tests/families/hybridtrain_dense
	touch $@

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages --without-pip $(VENV)
	$(BIN)/python -m pip --version >/dev/null 2>&1 || $(BIN)/python -m ensurepip -q
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP_UNCOMPILED) "$(TORCH_PIN)"
	$(PIP_UNCOMPILED) -e ".[test,plot,tb,docs]"
	$(COMPILE)
	touch $@

demo: setup
	$(BIN)/hybridtrain finetune -c examples/squad_tiny.yaml
	@echo
	@echo "Next: the command is $(BIN)/hybridtrain (or run 'source $(BIN)/activate' first), e.g."
	@echo "  $(BIN)/hybridtrain evaluate -c examples/squad_tiny.yaml"
	@echo "  $(BIN)/hybridtrain generate --model outputs/squad_tiny --prompt 'Context: ... Question: ... Answer:'"
	@echo "  $(BIN)/hybridtrain finetune -c examples/chat_lora_tiny.yaml"

# The suite on TEST_WORKERS processes (pytest-xdist): each test file whole on one of them, the
# files sharing a one-process reference together (tests/conftest.py).
TEST_WORKERS ?= 2

test: setup test-deps
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

clean:
	rm -rf $(VENV) outputs .pytest_cache
