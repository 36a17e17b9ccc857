"""benchmarks/gpu_check.sh --dry-run: every part of the GPU check runs on tiny shapes on the
CPU and its results come out as one table (the script is checked without a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~1.5 min on an idle 2-core CPU; six processes, each importing torch
def test_gpu_check_dry_run_prints_one_table(tmp_path):
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path), HYBRIDTRAIN_MAMBA_KERNELS="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=600).stdout
    rcs = {p.stem: p.read_text().strip() for p in tmp_path.glob("*.rc")}
    assert rcs and all(v == "rc=0" for v in rcs.values()), (rcs, out)
    for row in ("| nano8_kernels |", "| nano8_torch |", "| dense2b_kernels |", "| dense2b_torch |",
                "| hf_nano8 (transformers) |", "| decode batch 1 |", "| decode batch 2 |"):
        assert row in out and "failed" not in out.split(row)[1].split("\n")[0], (row, out)
    assert "tok/s" in out and "top 30 operators/kernels by self CPU time" in out
