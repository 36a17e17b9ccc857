# The two commands of the README: `make demo` and `make test` (the suite, every shell command of
# the README and the docs (scripts/run_doc_commands.py), then the docs site built with --strict:
# a broken link, anchor or page fails).
# Both create .venv (seeing system site-packages, so a cluster's CUDA torch is reused) and
# install the pinned CPU torch only when no torch is importable.
# Every other package is installed at the version of the lock file (docs/getting-started.md,
# "Dependencies"): `make lock` rewrites it, `make test-latest` tries the newest versions.
PY ?= python3
VENV ?= .venv
VENV_FLAGS ?= --system-site-packages
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= test,plot,tb,docs

# requirements/lock.txt: a pip constraints file, the exact versions of every package that
# `make setup` and `make test-deps` install (the project's dependencies and EXTRAS, the kernels
# below and what they pull in) but torch and Triton, which come with the machine's torch build
# where one is importable (a cluster's CUDA torch pins its own Triton) and else from TORCH_PIN
# and TRITON_PIN. `make lock` writes it from a fresh venv without system site-packages that
# runs these very targets unconstrained, so an extra added to EXTRAS or test-deps is locked too.
LOCK ?= requirements/lock.txt
CONSTRAINTS ?= -c $(LOCK)
LOCK_EXCLUDE := ^(torch|triton)==

# The GPU path's kernels, which the tests run on the CPU under Triton's interpreter
# (TRITON_INTERPRET=1): Triton, Liger-Kernel, and mamba_ssm without its CUDA extension
# (MAMBA_SKIP_CUDA_BUILD; FORCE_BUILD skips its prebuilt-wheel lookup; torch must be installed
# first). `make test` installs them once; a Triton or mamba_ssm already importable (a cluster's
# CUDA build) is kept. `make demo` does not need them.
# (Their versions but Triton's: the lock.)
TRITON_PIN ?= triton==3.7.1
KERNEL_PKGS ?= liger-kernel>=0.8.5 einops packaging
MAMBA_PKG ?= mamba-ssm>=2.2.5
# QLoRA's NF4 base (peft.base_quant: nf4) and training.float8, the `quant` extra; it requires no torch of its own
TORCHAO_PKG ?= torchao>=0.18
# The experiment trackers the suite runs offline (the wandb and mlflow extras; ~15 s to install)
TRACKER_PKGS ?= wandb>=0.31 mlflow-skinny>=3.18 sqlalchemy>=2.1 alembic>=1.20
# lm-evaluation-harness (the lm_eval extra; ~40 packages with scikit-learn, nltk, sacrebleu:
# 25 s of CPU to install, 2026-12-06)
LM_EVAL_PKG ?= lm-eval>=0.4.13

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

.PHONY: setup test-deps demo test test-compile test-cpu-kinds test-latest lock clean

setup: $(VENV)/.installed

# The test suite's own packages: those kernels, and the model family and the dataset the tests
# install from outside the source tree (tests/families/hybridtrain_dense and hybridtrain_lines,
# found through their entry points).
test-deps: $(VENV)/.test-deps

$(VENV)/.test-deps: $(VENV)/.installed Makefile $(LOCK) tests/families/hybridtrain_dense/pyproject.toml \
		tests/families/hybridtrain_lines/pyproject.toml
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q "$(TRITON_PIN)"
	$(BIN)/python -m pip install -q $(CONSTRAINTS) \
	  $(foreach p,$(KERNEL_PKGS) $(TRACKER_PKGS) $(LM_EVAL_PKG) $(TORCHAO_PKG),"$(p)") "$(TORCH_PIN)"
	$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('mamba_ssm') is None)" || \
	  MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE $(BIN)/python -m pip install -q --no-deps \
	    --no-build-isolation $(CONSTRAINTS) "$(MAMBA_PKG)"
	$(BIN)/python -m pip install -q --no-deps -e tests/families/hybridtrain_dense
	$(BIN)/python -m pip install -q --no-deps -e tests/families/hybridtrain_lines
	touch $@

$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV_FLAGS) --without-pip $(VENV)
	$(BIN)/python -m pip --version >/dev/null 2>&1 || $(BIN)/python -m ensurepip >/dev/null
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP_UNCOMPILED) "$(TORCH_PIN)"
	$(PIP_UNCOMPILED) $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	$(COMPILE)
	touch $@

demo: setup
	$(BIN)/hybridtrain finetune -c examples/squad_tiny.yaml
	@echo
	@echo "Next: the command is $(BIN)/hybridtrain (or run 'source $(BIN)/activate' first), e.g."
	@echo "  $(BIN)/hybridtrain evaluate -c examples/squad_tiny.yaml"
	@echo "  $(BIN)/hybridtrain generate --model outputs/squad_tiny --prompt 'Context: ... Question: ... Answer:'"
	@echo "  $(BIN)/hybridtrain finetune -c examples/chat_lora_tiny.yaml"

# The suite on TEST_WORKERS processes (pytest-xdist): each test file whole on one of them, or a
# test's own xdist_group (tests/conftest.py). (Four workers and the doc commands beside the suite
# were tried on 2026-12-06: the 2-4-rank gloo groups of four workers at once oversubscribe the
# 2 cores many times over, and the suite ran slower.) Then the doc commands, two at a time
# (both parts keep 2 cores busy: run one after the other, they take the sum of their CPU time).
# Both parts start ~300 Python processes that import the project and (the suite's workers) the
# test modules in pytest's rewritten form: they write their bytecode into __pycache__ (ignored by
# git) even where PYTHONDONTWRITEBYTECODE is set (as on this project's test machines), so each
# module is compiled once, not in every process (~0.3 CPU-s a process, 4 a pytest worker).
TEST_WORKERS ?= 2

test: setup test-deps
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests
	PYTHONDONTWRITEBYTECODE= $(BIN)/python scripts/run_doc_commands.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

# Every block type compiled by inductor with the real kernels, plain and checkpointed, under TP
# and CP (tests/distributed/test_compiled_inductor.py; `make test` runs one: attention
# checkpointed under TP). 341 CPU-s of C++ compiles on 2 cores: not part of `make test` or CI.
test-compile: setup test-deps
	HYBRIDTRAIN_COMPILE_MATRIX=all $(BIN)/python -m pytest -q -p no:randomly -n 0 tests/distributed/test_compiled_inductor.py

# The tests whose bounds or tolerances depend on the CPU's kernels (the memory plan against real
# allocations, bf16 numerics, the GEMM kernel caches, the kernel-dependent step anatomy), run
# under each kind of machine CI uses, emulated on a CPU with AVX-512 by the switches of torch's
# kernel libraries (tests/helpers/cpu_kind.py: ATen, oneDNN, MKL): no-avx512 (AMD Zen 2/3),
# avx512-bf16 (Zen 4, no AMX). On a CPU without AVX-512 only no-avx512 is the machine's own.
# Not part of `make test` (which runs the VLM plan's pipeline case under no-avx512 on an AVX-512
# CPU): run it when a change touches the plan's figures or a tolerance.
CPU_KINDS ?= no-avx512 avx512-bf16
CPU_KERNEL_TESTS ?= tests/distributed/test_plan_vlm.py tests/distributed/test_plan_layouts.py \
  tests/distributed/test_qlora_plan_peak.py tests/distributed/test_plan_pipeline_reshard.py \
  tests/distributed/test_load_memory.py tests/distributed/test_qlora_load_memory.py \
  tests/unit/test_plan.py tests/unit/test_backend.py tests/unit/test_config_dist_env.py \
  tests/unit/test_precision.py tests/unit/test_dtype_traffic.py tests/unit/test_step_anatomy.py \
  tests/unit/test_lora.py tests/unit/test_qlora.py tests/unit/test_float8.py tests/unit/test_loss.py \
  tests/unit/test_fused_loss.py

test-cpu-kinds: setup test-deps
	for kind in $(CPU_KINDS); do \
	  $(BIN)/python -m tests.helpers.cpu_kind $$kind --show && \
	  $(BIN)/python -m tests.helpers.cpu_kind $$kind $(BIN)/python -m pytest -q -n $(TEST_WORKERS) \
	    --dist loadgroup $(CPU_KERNEL_TESTS) || exit 1; \
	done

# The newest versions pyproject allows (no lock; torch from TORCH_PIN) in a venv of their own,
# against the tests that pin this code to other packages' behaviour: parity with transformers
# and PEFT's files, mamba_ssm's and Liger's kernels, pytest-xdist's groups. A failure names the
# test that drifted; the list before the tests shows each package whose version differs from the
# lock (< lock, > newest). Not part of `make test` or CI: run it before `make lock`. (A fresh
# venv compiles everything cold: the tests get 20 minutes each.)
LATEST_VENV ?= .venv-latest
DRIFT_TESTS ?= tests/unit/test_model_parity.py tests/unit/test_hf_io.py tests/unit/test_generation.py \
  tests/unit/test_mamba_kernel_contracts.py tests/unit/test_real_kernels.py tests/unit/test_fused_loss.py \
  tests/unit/test_xdist_groups.py

test-latest:
	rm -rf $(LATEST_VENV)
	$(MAKE) --no-print-directory VENV=$(LATEST_VENV) VENV_FLAGS= LOCK= CONSTRAINTS= TRITON_PIN=triton COMPILE=: test-deps
	$(LATEST_VENV)/bin/python -m pip freeze --exclude-editable | grep -v -E '$(LOCK_EXCLUDE)' > $(LATEST_VENV)/freeze.txt
	@echo "versions other than the lock's (< lock, > newest):"
	@grep -v '^#' $(LOCK) | diff - $(LATEST_VENV)/freeze.txt | grep '^[<>]' || echo "  none"
	$(LATEST_VENV)/bin/python -m pytest -q -p no:randomly --timeout 1200 -n $(TEST_WORKERS) --dist loadgroup $(DRIFT_TESTS)

# Rewrites the lock from a fresh venv (no system site-packages, nothing constrained: the newest
# versions pyproject and the targets above allow), then removes that venv. Run `make test` (and
# `make test-latest` first, to see what moved) before committing the new lock.
LOCK_VENV ?= .venv-lock

lock:
	rm -rf $(LOCK_VENV)
	$(MAKE) --no-print-directory VENV=$(LOCK_VENV) VENV_FLAGS= LOCK= CONSTRAINTS= COMPILE=: test-deps
	mkdir -p $(dir $(LOCK))
	{ echo "# The versions the suite passed with: pip constraints (pip install -c $(LOCK))."; \
	  echo "# Written by 'make lock' (Python $$($(LOCK_VENV)/bin/python -c 'import platform; print(platform.python_version())')); do not edit. torch and triton: see the Makefile."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -v -E '$(LOCK_EXCLUDE)'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(LOCK_VENV) outputs .pytest_cache
