"""`hybridtrain finetune --nproc-per-node 2` stopped by a signal: SIGTERM to the launcher reaches
both workers, which agree on the step, save, and exit 75 like the launcher (one message, no
traceback), and the resumed run matches the uninterrupted 2-rank run exactly; SIGUSR1 to one
worker alone stops both at the same step. A start-up error is printed once and exits 2."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tests.helpers.distributed import run_distributed
from tests.helpers.recipes import tiny_recipe

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc")]


def _argv(tmp: Path, out: Path, *extra: str) -> list[str]:
    recipe = tmp / "recipe.yaml"
    if not recipe.exists():
        recipe.write_text(yaml.safe_dump(tiny_recipe()))
    return [sys.executable, "-m", "hybridtrain", "finetune", "-c", str(recipe),
            "--nproc-per-node", "2", f"--checkpoint.dir={out}", "--metrics.progress_bar=false",
            "--metrics.peak_tflops=1.0", f"--training.max_steps={STEPS}",
            "--training.ckpt_every_steps=5", "--checkpoint.save_hf_at_end=false", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)


def _messages(err: str, start: str) -> list[str]:
    """The lines of the workers' stderr that start with ``start`` after the launcher's
    ``[rank N] `` prefix."""
    lines = (re.fullmatch(r"\[rank \d+\] (.*)", x) for x in err.splitlines())
    return [m.group(1) for m in lines if m and m.group(1).startswith(start)]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in open(out / "training.jsonl")]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _signal_after_first_step(argv: list[str], out: Path, sig: int, to_one_worker: bool = False
                             ) -> tuple[int, str]:
    """Starts ``argv``, sends ``sig`` (to the launcher, or to one worker) once a step is
    logged; returns (exit status, stderr)."""
    p = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        path = out / "training.jsonl"
        deadline = time.time() + 200
        while not (path.exists() and path.stat().st_size):
            assert p.poll() is None and time.time() < deadline, "the run ended early"
            time.sleep(0.05)
        target = _children(p.pid)[-1] if to_one_worker else p.pid
        os.kill(target, sig)
        _, err = p.communicate(timeout=200)
        return p.returncode, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _train(rank: int, world: int, argv: list[str]) -> None:
    """What a worker of ``argv``'s launch runs: its recipe and overrides, trained in this rank."""
    from hybridtrain.config import load_config
    from hybridtrain.config.loader import parse_overrides
    from hybridtrain.recipes.finetune import run

    recipe, overrides = argv[argv.index("-c") + 1], argv[argv.index("--nproc-per-node") + 2:]
    run(load_config(recipe, parse_overrides(overrides)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted 2-rank run of the tests' command, its ranks started from the test
    helpers' fork server (torch already imported) instead of a launch (3 fresh processes)."""
    tmp = tmp_path_factory.mktemp("ref2")
    run_distributed(_train, 2, _argv(tmp, tmp / "run"))
    return _records(tmp / "run")


def _assert_stopped(out: Path, code: int, err: str, sig: int) -> int:
    assert code == 75, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    reached = _records(out)[-1]["step"]
    assert 1 <= reached < STEPS
    assert (out / "latest").read_text().strip() == f"step_{reached}"
    state = json.loads((out / f"step_{reached}" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == reached
    lines = _messages(err, "hybridtrain:")
    assert lines == [f"hybridtrain: {signal.Signals(sig).name} received: stopped after step "
                     f"{reached} of {STEPS}; saved {out}/step_{reached}; resume with "
                     "--checkpoint.resume=auto"], err[-3000:]
    assert not (out / ".lock").exists()
    return reached


def test_sigterm_to_the_launcher_stops_both_ranks_and_resumes_exactly(tmp_path, uninterrupted):
    out = tmp_path / "run"
    code, err = _signal_after_first_step(_argv(tmp_path, out), out, signal.SIGTERM)
    _assert_stopped(out, code, err, signal.SIGTERM)
    r = _run(_argv(tmp_path, out, "--checkpoint.resume=auto"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = _records(out)
    assert [x["step"] for x in got] == list(range(1, STEPS + 1))
    assert [(x["loss"], x["grad_norm"]) for x in got] == \
        [(x["loss"], x["grad_norm"]) for x in uninterrupted]


def test_sigusr1_to_one_worker_stops_both_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    code, err = _signal_after_first_step(_argv(tmp_path, out), out, signal.SIGUSR1,
                                         to_one_worker=True)
    _assert_stopped(out, code, err, signal.SIGUSR1)


def test_a_startup_error_is_printed_once_and_exits_2(tmp_path):
    out = tmp_path / "run"
    r = _run(_argv(tmp_path, out, "--training.global_batch_size=6"))
    assert r.returncode == 2, r.stderr[-3000:]
    errors = _messages(r.stderr, "hybridtrain: error:")
    assert len(errors) == 1 and "global_batch_size" in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
