"""dist_env: name mapping, bool mapping, existing environment wins (reported once), null
rejection."""

from __future__ import annotations

import logging
import textwrap

import pytest

from hybridtrain.config import (
    apply_dist_env,
    apply_process_defaults,
    dist_env_vars,
    load_config,
)
from hybridtrain.config import dist_env as dist_env_mod
from hybridtrain.config.dist_env import (
    GEMM_KERNEL_CACHE_ENTRIES, GEMM_KERNEL_CACHE_VARS, busy_cores, omp_wait_policy,
)


@pytest.fixture(autouse=True)
def _fresh_reports():
    dist_env_mod._REPORTED.clear()
    yield
    dist_env_mod._REPORTED.clear()


def test_names_and_values_mapping():
    assert dist_env_vars({
        "torch_nccl_use_comm_nonblocking": True,
        "nccl_nvls_enable": False,
        "pytorch_alloc_conf": "expandable_segments:True",
        "omp_num_threads": 4,
        "some_float": 0.5,
    }) == {
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
        "NCCL_NVLS_ENABLE": "0",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        "OMP_NUM_THREADS": "4",
        "SOME_FLOAT": "0.5",
    }


def test_apply_sets_missing_and_existing_wins_reported_once(caplog):
    env = {"NCCL_DEBUG": "INFO"}
    section = {"nccl_debug": "WARN", "torch_nccl_use_comm_nonblocking": True}
    with caplog.at_level(logging.INFO, logger="hybridtrain.config.dist_env"):
        applied = apply_dist_env(section, environ=env)
        applied2 = apply_dist_env(section, environ=env)
    assert applied == {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
    assert applied2 == {}  # already there now
    assert env == {"NCCL_DEBUG": "INFO", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "NCCL_DEBUG" in warnings[0].getMessage() and "'INFO'" in warnings[0].getMessage()
    assert "'WARN'" in warnings[0].getMessage()


def test_same_value_already_set_is_not_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="hybridtrain.config.dist_env"):
        assert apply_dist_env({"nccl_debug": "WARN"}, environ={"NCCL_DEBUG": "WARN"}) == {}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_null_rejected_with_key_and_line(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent("""\
        dist_env:
          nccl_debug: WARN
          pytorch_alloc_conf: null
        """))
    with pytest.raises(ValueError) as e:
        load_config(path)
    msg = str(e.value)
    assert "dist_env.pytorch_alloc_conf is null" in msg and f"{path}:3" in msg
    assert "None" not in msg
    env: dict[str, str] = {}
    with pytest.raises(ValueError, match="dist_env.pytorch_alloc_conf is null"):
        apply_dist_env({"pytorch_alloc_conf": None}, environ=env)
    assert env == {}  # nothing exported, never the string "None"


def test_null_via_override_rejected(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("dist_env:\n  nccl_debug: WARN\n")
    with pytest.raises(ValueError, match=r"dist_env.nccl_debug is null \(command-line override"):
        load_config(path, ["--dist_env.nccl_debug=null"])


def test_bad_values_and_names():
    with pytest.raises(ValueError, match="must be a string, number or boolean"):
        dist_env_vars({"nccl_debug": ["a"]})
    with pytest.raises(ValueError, match="not a valid environment variable name"):
        dist_env_vars({"nccl-debug": "x"})
    with pytest.raises(ValueError, match="both set NCCL_DEBUG"):
        dist_env_vars({"nccl_debug": "x", "NCCL_DEBUG": "y"})


def test_loaded_section_applies(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("dist_env:\n  torch_nccl_use_comm_nonblocking: true\n  nccl_debug: ${env:D,WARN}\n")
    cfg = load_config(path, environ={})
    env: dict[str, str] = {}
    assert apply_dist_env(cfg.dist_env, environ=env) == {
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1", "NCCL_DEBUG": "WARN"}


def test_process_defaults_fill_only_what_environment_and_recipe_left_unset():
    caches = {name: str(GEMM_KERNEL_CACHE_ENTRIES) for name in GEMM_KERNEL_CACHE_VARS}
    env = {}
    apply_dist_env({"nccl_debug": "WARN"}, environ=env)
    assert apply_process_defaults(environ=env, others=2.0) == {"OMP_WAIT_POLICY": "PASSIVE", **caches}
    assert env == {"NCCL_DEBUG": "WARN", "OMP_WAIT_POLICY": "PASSIVE", **caches}
    recipe = {}
    apply_dist_env({"omp_wait_policy": "ACTIVE", "onednn_primitive_cache_capacity": 1024},
                   environ=recipe)  # the recipe wins
    assert apply_process_defaults(environ=recipe, others=2.0) == {"LRU_CACHE_CAPACITY": "128"}
    assert recipe["OMP_WAIT_POLICY"] == "ACTIVE" and recipe["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
    user = {"OMP_WAIT_POLICY": "active", **dict.fromkeys(GEMM_KERNEL_CACHE_VARS, "7")}
    apply_dist_env({"omp_wait_policy": "PASSIVE"}, environ=user)  # the environment wins over both
    assert apply_process_defaults(environ=user, others=2.0) == {}
    assert user == {"OMP_WAIT_POLICY": "active", **dict.fromkeys(GEMM_KERNEL_CACHE_VARS, "7")}
    idle = {}
    assert apply_process_defaults(environ=idle, others=0.1) == caches and idle == caches


@pytest.mark.parametrize("others,nproc,threads,cores,policy", [
    (0.1, 1, None, 2, None),       # an idle machine: libgomp's default (a short spin)
    (1.0, 1, None, 2, "PASSIVE"),  # one busy process beside 2 threads on 2 cores
    (0.1, 2, None, 2, None),       # 2 launched workers of one thread each on 2 cores
    (1.0, 2, None, 2, "PASSIVE"),
    (0.2, 2, "2", 2, "PASSIVE"),   # 2 workers x 2 threads on 2 cores
    (3.0, 1, "4", 8, None),        # 4 threads beside 3 busy cores of 8
])
def test_passive_only_on_oversubscribed_cores(others, nproc, threads, cores, policy):
    env = {} if threads is None else {"OMP_NUM_THREADS": threads}
    assert omp_wait_policy(env, nproc, others=others, cores=cores) == policy


def test_busy_cores_sees_a_busy_process():
    import subprocess
    import sys

    if busy_cores(0.05) is None:
        pytest.skip("no /proc/stat")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)
        busy = busy_cores(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert busy >= 0.5  # the spinning process (and whatever else runs here)
