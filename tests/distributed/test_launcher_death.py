"""`kill -9` of `hybridtrain finetune --nproc-per-node 2` (which has become torchrun) ends its
workers within seconds instead of leaving them to train on as orphans."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tests.helpers.recipes import tiny_recipe

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc (Linux)")
def test_workers_end_when_the_launcher_is_killed(tmp_path):
    out = tmp_path / "run"
    # the tiny model on synthetic rows: no tokenizer or data to build before the first step
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe()))
    argv = [sys.executable, "-m", "hybridtrain", "finetune", "-c", str(recipe),
            "--nproc-per-node", "2", f"--checkpoint.dir={out}", "--training.max_steps=100000",
            "--training.ckpt_every_steps=0", "--metrics.progress_bar=false",
            "--metrics.peak_tflops=1.0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.time() + 240
        while time.time() < deadline:  # training has started on the workers
            if (out / "training.jsonl").exists() and (out / "training.jsonl").stat().st_size:
                workers = _children(launcher.pid)
                break
            assert launcher.poll() is None, "the run ended early"
            time.sleep(0.05)
        assert len(workers) == 2, workers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        t0 = time.time()
        while any(_alive(w) for w in workers) and time.time() - t0 < 15:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers), "workers outlived their launcher by 15 s"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
