"""Readers of a run folder (convert, generate --model, evaluate) never write into it: no lock
taken or broken, no ``.step_N.tmp`` cleaned (only the lock holder cleans), and a step that a live
run's ``keep_last`` rotation removes is pinned while it is read or, where it goes all the same,
named as removed (never "truncated or corrupt") and the run folder's newest read instead."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from tests.helpers.models import standin_model
from tests.helpers.recipes import tiny_recipe

from hybridtrain import runfolder
from hybridtrain.cli import main
from hybridtrain.runfolder import LOCK_NAME, RunLock
from hybridtrain.training import checkpoint_reader as ck
from hybridtrain.training.checkpoint import Checkpointer
from hybridtrain.training.checkpoint_reader import read_checkpoint
from hybridtrain.training.preemption import EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[2]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def _small() -> torch.nn.Module:
    return standin_model()


def test_a_live_run_saving_every_step_survives_its_readers(tmp_path, capsys):
    """A training saving every step with keep_last 1 in a subprocess; convert, generate's loader
    and evaluate's sharded load read its folder meanwhile: each reads a whole checkpoint, the
    training goes on (its `.step_N.tmp` and lock untouched) and stops normally on SIGTERM."""
    from hybridtrain.training.checkpoint_reader import load_checkpoint_model

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe()))
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    train = subprocess.Popen(
        [sys.executable, "-m", "hybridtrain", "finetune", "-c", str(recipe),
         f"--checkpoint.dir={out}", "--training.max_steps=100000",
         "--training.ckpt_every_steps=1", "--checkpoint.keep_last=1",
         "--checkpoint.save_hf_at_end=false", "--metrics.progress_bar=false"],
        env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (out / "latest").exists() and train.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert train.poll() is None, train.stderr.read()[-3000:]
        # what a dead writer would have left: only the lock holder may remove it (at its start)
        (out / ".step_999999.tmp").mkdir()
        lock = (out / LOCK_NAME).read_text()
        for i in range(2):
            assert main(["convert", str(out), str(tmp_path / f"hf{i}")]) == 0
            assert (tmp_path / f"hf{i}" / "config.json").exists()
            assert list((tmp_path / f"hf{i}").glob("*.safetensors"))
        model, _ = load_checkpoint_model(str(out))  # generate --model RUN (no export)
        # evaluate under a layout: the recipe's checkpointer, a sharded load
        reader, target = Checkpointer(str(out)), type(model)(model.config)
        step, state = read_checkpoint(str(out), lambda s: (s, reader.load(s, target)))
        assert state["step"] == int(os.path.basename(step).split("_")[1])
        assert train.poll() is None  # the training is still running
        assert (out / ".step_999999.tmp").is_dir() and (out / LOCK_NAME).read_text() == lock
        assert "truncated or corrupt" not in capsys.readouterr().err
        train.send_signal(signal.SIGTERM)
        assert train.wait(timeout=120) == EXIT_PREEMPTED
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    err = train.stderr.read()
    assert "Traceback" not in err, err[-3000:]
    assert not (out / LOCK_NAME).exists()


def test_readers_leave_a_held_run_folder_as_it_is(tmp_path, capsys):
    """convert, generate's loader and evaluate's checkpointer on a folder a live process holds:
    nothing in the folder changes (its lock and a `.step_N.tmp` stay; a reader takes no lock)."""
    from tests.helpers.models import tiny_model

    from hybridtrain.training.checkpoint_reader import load_checkpoint_model

    out = tmp_path / "run"
    Checkpointer(str(out)).save(2, tiny_model(), None)
    (out / ".step_3.tmp" / "dcp").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK_NAME).write_text(f"{os.uname().nodename} {holder.pid}\n")
        before = _snapshot(out)
        assert main(["convert", str(out), str(tmp_path / "hf")]) == 0
        load_checkpoint_model(str(out))  # generate --model RUN (a step without an export)
        Checkpointer(str(out), keep_last=1)  # what evaluate under a layout builds
        assert _snapshot(out) == before
        assert runfolder.live_holder(out) == f"process {holder.pid} on {os.uname().nodename}"
    finally:
        holder.kill()
        holder.wait()
    assert runfolder.live_holder(out) is None  # its holder is gone: stale
    with RunLock(out):  # the next writer cleans what the dead one left
        assert not (out / ".step_3.tmp").exists()


def test_a_pinned_step_outlives_keep_last_until_its_reader_is_done(tmp_path):
    run = tmp_path / "run"
    writer = Checkpointer(str(run), keep_last=1)
    writer.save(1, _small(), None)
    pin = runfolder.pin_step(run / "step_1")
    try:
        writer.save(2, _small(), None)
        assert writer.steps() == [1, 2]  # kept while a reader reads it
        loaded = Checkpointer(str(run)).load(str(run / "step_1"), _small())
        assert loaded["step"] == 1
    finally:
        os.close(pin)
    writer.save(3, _small(), None)
    assert writer.steps() == [3]
    assert not list(run.glob(".step_*"))


@pytest.fixture
def no_file_locks(monkeypatch):
    """A file system without locks: readers cannot pin, rotation removes what they read."""
    monkeypatch.setattr(ck, "pin_step", lambda step: None)


def _rotating_read(run: Path, writer: Checkpointer, rotations: int):
    """A read that, the first ``rotations`` times, sees the live run save a newer step (which
    rotates the step being read away) before it reads."""
    calls = []

    def read(step):
        calls.append(os.path.basename(step))
        if len(calls) <= rotations:
            writer.save(int(writer.steps()[-1]) + 1, _small(), None)
        return Checkpointer(str(run)).load(step, _small())["step"]
    return read, calls


def test_without_locks_a_rotated_step_is_retried_with_the_newest(tmp_path, no_file_locks,
                                                               caplog):
    run = tmp_path / "run"
    writer = Checkpointer(str(run), keep_last=1)
    writer.save(1, _small(), None)
    read, calls = _rotating_read(run, writer, rotations=2)
    with caplog.at_level(logging.WARNING):
        assert read_checkpoint(str(run), read) == 3
    assert calls == ["step_1", "step_2", "step_3"]
    assert f"{run}/step_1 was removed by the run writing {run} while it was being read; " \
        "reading its newest checkpoint instead" in caplog.text


def test_without_locks_a_named_rotated_step_is_reported_as_removed(tmp_path, no_file_locks):
    run = tmp_path / "run"
    writer = Checkpointer(str(run), keep_last=1)
    writer.save(1, _small(), None)
    read, _ = _rotating_read(run, writer, rotations=1)
    with RunLock(run), pytest.raises(ValueError) as e:
        read_checkpoint(str(run / "step_1"), read)
    msg = str(e.value)
    assert "truncated or corrupt" not in msg
    assert f"checkpoint {run}/step_1 went away while it was being read: a live run holds this " \
        f"folder (process {os.getpid()} on " in msg and "checkpoint.keep_last" in msg


def test_without_locks_a_run_rotating_faster_than_the_read_is_named(tmp_path, no_file_locks):
    run = tmp_path / "run"
    writer = Checkpointer(str(run), keep_last=1)
    writer.save(1, _small(), None)
    read, calls = _rotating_read(run, writer, rotations=100)
    with RunLock(run), pytest.raises(ValueError, match=rf"^{run}: a live run holds this folder "
                                     r"\(process \d+ on .*\) and removed each of its last 5 "
                                     r"checkpoints while it was being read"):
        read_checkpoint(str(run), read)
    assert len(calls) == ck.READ_TRIES


def test_a_corrupt_step_that_stays_is_still_called_corrupt(tmp_path):
    run = tmp_path / "run"
    Checkpointer(str(run)).save(1, _small(), None)
    for f in (run / "step_1" / "dcp").glob("*.distcp"):
        f.write_bytes(b"")
    with pytest.raises(ValueError, match="step_1 is truncated or corrupt"):
        read_checkpoint(str(run), lambda s: Checkpointer(str(run)).load(s, _small()))
