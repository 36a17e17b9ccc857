"""A one-process `finetune` stopped by SIGTERM / SIGUSR1 or `training.max_time`: it saves a
checkpoint at the step reached, releases the run folder, exits 75, and the resumed run matches
the uninterrupted one exactly. The signals are sent from a thread of this process once the
first step is logged (the handlers are installed by then), never after a sleep."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import yaml
from tests.helpers.recipes import tiny_recipe

from hybridtrain.cli import main
from hybridtrain.config.text_values import parse_duration
from hybridtrain.runfolder import LOCK_NAME
from hybridtrain.training.preemption import EXIT_PREEMPTED, RunStop

STEPS = 8


def _args(tmp_path, out, *extra):
    recipe = tmp_path / "recipe.yaml"
    if not recipe.exists():
        recipe.write_text(yaml.safe_dump(tiny_recipe()))
    return ["finetune", "-c", str(recipe), f"--checkpoint.dir={out}",
            "--metrics.progress_bar=false", "--metrics.peak_tflops=1.0",
            f"--training.max_steps={STEPS}", "--training.ckpt_every_steps=5",
            "--checkpoint.save_hf_at_end=false", *extra]


def _records(out) -> list[dict]:
    return [json.loads(line) for line in open(out / "training.jsonl")]


def _signal_after_first_step(out, sig: int) -> threading.Thread:
    """Sends ``sig`` to this process once ``out/training.jsonl`` has a line and the run's
    handler is installed (so a missing handler fails the test instead of killing pytest)."""
    def send():
        path = out / "training.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and not (path.exists() and path.stat().st_size):
            time.sleep(0.02)
        if signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            os.kill(os.getpid(), sig)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    assert main(_args(tmp, tmp / "run")) == 0
    return _records(tmp / "run")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_saves_exits_75_and_resumes_exactly(tmp_path, capsys, uninterrupted, sig):
    out = tmp_path / "run"
    before = signal.getsignal(sig)
    sender = _signal_after_first_step(out, sig)
    assert main(_args(tmp_path, out)) == EXIT_PREEMPTED
    sender.join()
    assert signal.getsignal(sig) is before  # handlers restored
    reached = _records(out)[-1]["step"]
    assert 1 <= reached < STEPS
    assert (out / "latest").read_text().strip() == f"step_{reached}"
    assert not (out / LOCK_NAME).exists()
    err = capsys.readouterr().err
    line = (f"hybridtrain: {sig.name} received: stopped after step {reached} of {STEPS}; saved "
            f"{out}/step_{reached}; resume with --checkpoint.resume=auto")
    assert [x for x in err.splitlines() if x.startswith("hybridtrain:")] == [line]
    assert main(_args(tmp_path, out, "--checkpoint.resume=auto")) == 0
    got = _records(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["grad_norm"]) for r in got] == \
        [(r["loss"], r["grad_norm"]) for r in uninterrupted]


def test_a_signal_during_a_save_lets_the_save_finish(tmp_path, capsys, monkeypatch):
    """SIGTERM, then SIGUSR1, arrive while step_5 is being written: the save completes, the run
    stops right after it (no second save of the same step) with exit 75."""
    from hybridtrain.training import checkpoint

    save = checkpoint.Checkpointer.save

    def save_under_signals(self, step, *a, **kw):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
        return save(self, step, *a, **kw)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_under_signals)
    out = tmp_path / "run"
    assert main(_args(tmp_path, out)) == EXIT_PREEMPTED
    assert sorted(p.name for p in out.glob("step_*")) == ["step_5"]
    assert not list(out.glob(".step_*"))
    err = capsys.readouterr().err
    assert "SIGTERM received: stopped after step 5" in err
    assert "SIGTERM, SIGUSR1 received while a checkpoint was being written" in err


def test_max_time_stops_with_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(_args(tmp_path, out, "--training.max_time=2s", "--training.max_steps=100000"))
    assert code == EXIT_PREEMPTED
    reached = _records(out)[-1]["step"]
    assert (out / "latest").read_text().strip() == f"step_{reached}"
    assert f"training.max_time=2s is near: stopped after step {reached} of 100000" in \
        capsys.readouterr().err


@pytest.mark.parametrize("value", ["90", "3m50h", "1x", "0s"])
def test_max_time_needs_a_duration_with_units(tmp_path, capsys, value):
    assert main(_args(tmp_path, tmp_path / "run", f"--training.max_time={value}")) == 2
    err = capsys.readouterr().err
    assert "training.max_time" in err and ("3h50m" in err or "longer than 0s" in err)
    assert not (tmp_path / "run").exists()


def test_durations_and_signal_names():
    assert parse_duration("3h50m") == 13800 and parse_duration("90s") == 90
    assert parse_duration("45m") == 2700 and parse_duration("1d2h") == 93600
    from hybridtrain.config import build_config

    cfg = build_config({"checkpoint": {"save_on_signal": []}})
    assert not RunStop.from_config(cfg).active  # [] -> the signals keep their default action
    cfg = build_config({"checkpoint": {"save_on_signal": ["usr2", "SIGTERM"]}})
    assert RunStop.from_config(cfg).signals == [signal.SIGUSR2, signal.SIGTERM]
    with pytest.raises(ValueError, match="checkpoint.save_on_signal: 'SIGKILL' is not a signal"):
        build_config({"checkpoint": {"save_on_signal": ["SIGKILL"]}})


@pytest.mark.parametrize("recipe", ["dpo", "grpo"])
def test_rl_recipes_stop_on_a_signal_with_a_checkpoint(tmp_path, recipe, monkeypatch):
    import importlib

    from tests.unit.test_rl_recipes import rl_recipe, signal_after_step

    from hybridtrain.training.preemption import Preempted

    cfg = rl_recipe(tmp_path, recipe)
    cfg["training"]["max_steps"] = 50
    out = tmp_path / "run"
    signal_after_step(monkeypatch, signal.SIGUSR1, 1)
    with pytest.raises(Preempted, match=rf"SIGUSR1 received: {recipe} stopped after step 1 "
                                        "of 50; saved .*step_"):
        importlib.import_module(f"hybridtrain.recipes.{recipe}").run(cfg)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert _records(out)[-1]["step"] == 1 and (out / "latest").exists()


def test_a_signal_during_start_up_stops_at_once_and_frees_the_folder(tmp_path, capsys,
                                                                      monkeypatch):
    from hybridtrain.recipes import finetune

    build = finetune.build

    def build_then_signal(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # its handler raises at once
        return build(*a, **kw)

    monkeypatch.setattr(finetune, "build", build_then_signal)
    out = tmp_path / "run"
    assert main(_args(tmp_path, out)) == EXIT_PREEMPTED
    assert "SIGTERM received outside the training steps" in capsys.readouterr().err
    assert not out.exists()  # nothing written; the lock released with the empty folder
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _signal_during_save(monkeypatch, sig: int, step: int) -> list:
    """``sig`` to this process while ``step_{step}`` is being written (between its sharded
    tensors and its JSON files), if a handler is installed (a default action would end pytest).
    Returns what the save found: one (handler, signal sent) pair per write of that step."""
    from hybridtrain.training import checkpoint

    real = checkpoint.dcp_save
    found = []

    def dcp_save_under_signal(tensors, path):
        if f".step_{step}.tmp" in path:
            handler = signal.getsignal(sig)
            sent = handler not in (signal.SIG_DFL, signal.SIG_IGN, None)
            found.append((handler, sent))
            if sent:
                os.kill(os.getpid(), sig)
        return real(tensors, path)

    monkeypatch.setattr(checkpoint, "dcp_save", dcp_save_under_signal)
    return found


def _complete(out, step: int) -> None:
    assert (out / "latest").read_text().strip() == f"step_{step}"
    assert (out / f"step_{step}" / "trainer_state.json").exists()
    assert not list(out.glob(".step_*")) and not (out / LOCK_NAME).exists()


@pytest.mark.parametrize("recipe", ["finetune", "dpo", "grpo"])
def test_a_signal_during_the_final_save_waits_for_it(tmp_path, capsys, caplog, monkeypatch,
                                                     recipe):
    """SIGTERM while the last checkpoint is written: the save completes and the run finishes."""
    import importlib

    from tests.unit.test_rl_recipes import rl_recipe

    out = tmp_path / "run"
    last = STEPS if recipe == "finetune" else 2
    _signal_during_save(monkeypatch, signal.SIGTERM, last)
    if recipe == "finetune":
        assert main(_args(tmp_path, out)) == 0
    else:
        cfg = rl_recipe(tmp_path, recipe)
        cfg["training"]["max_steps"] = last
        importlib.import_module(f"hybridtrain.recipes.{recipe}").run(cfg)
    _complete(out, last)
    logged = caplog.text + capsys.readouterr().err  # (main() logs to stderr)
    assert "SIGTERM received after the last step: the run finished" in logged
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_ctrl_c_during_a_save_exits_130_after_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    # Ctrl-C as in a terminal: Python's handler, the signal not blocked (whatever an earlier test
    # in this worker process left)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        found = _signal_during_save(monkeypatch, signal.SIGINT, 5)
        status = main(_args(tmp_path, out))
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert found and found[0][1], f"no handler for SIGINT during the save: {found}"
    assert status == 130
    _complete(out, 5)
    assert _records(out)[-1]["step"] == 5
    err = capsys.readouterr().err
    assert "hybridtrain: interrupted" in err and "Traceback" not in err


def test_a_signal_while_the_cli_imports_torch_exits_75(tmp_path, capsys, monkeypatch):
    from hybridtrain import cli

    load = cli._load_entry

    def signal_then_load(*a):
        os.kill(os.getpid(), signal.SIGTERM)  # as if torch were being imported
        return load(*a)

    monkeypatch.setattr(cli, "_load_entry", signal_then_load)
    out = tmp_path / "run"
    assert main(_args(tmp_path, out)) == EXIT_PREEMPTED
    assert "hybridtrain: SIGTERM received outside the training steps: stopped without a new " \
        "checkpoint" in capsys.readouterr().err
    assert not out.exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_sigterm_as_soon_as_python_m_hybridtrain_starts_exits_75(tmp_path):
    """SIGTERM as soon as `python -m hybridtrain finetune` catches it (long before torch is
    imported): exit 75 without a checkpoint, so that a requeue on 75 fires."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo)])}
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hybridtrain", *_args(tmp_path, out)],
                            env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not _catches(proc.pid, signal.SIGTERM) and proc.poll() is None \
            and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED
    err = proc.stderr.read()
    assert "hybridtrain: SIGTERM received outside the training steps" in err
    assert "Traceback" not in err and not list(tmp_path.glob("run/step_*"))


@pytest.mark.parametrize("rc,requeued", [(EXIT_PREEMPTED, True), (2, False), (0, False)])
def test_the_slurm_example_requeues_on_75(tmp_path, rc, requeued):
    """examples/slurm_nemotron3_nano.sbatch with stand-ins for srun and scontrol: the job is
    requeued exactly when the ranks exit 75, and the script exits with their status."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "slurm_nemotron3_nano.sbatch"
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "activate").write_text("")
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\nexit {rc}\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n'
                                      'echo node1\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "REPO": str(repo), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node1", "HOME": str(tmp_path)}
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == rc, res.stderr
    log = (tmp_path / "scontrol.log").read_text()
    assert ("requeue 42" in log) == requeued
