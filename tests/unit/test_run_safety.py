"""Start-up and failure behaviour of `hybridtrain finetune`, through the CLI: a layout that needs
more ranks, a refused run that leaves the folder alone, the run-folder lock, divergence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from tests.helpers.recipes import tiny_recipe

from hybridtrain.cli import main
from hybridtrain.runfolder import LOCK_NAME, RunFolderBusy, RunLock


def _recipe(tmp_path, **sections):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(**sections)))
    return str(path)


def _args(tmp_path, out, *extra):
    return ["finetune", "-c", _recipe(tmp_path), f"--checkpoint.dir={out}",
            "--metrics.progress_bar=false", "--training.max_steps=2", *extra]


@pytest.mark.parametrize("degrees,need", [(["--distributed.pp=2"], 2),
                                          (["--distributed.pp=2", "--distributed.ep=2"], 4),
                                          (["--distributed.tp=2", "--distributed.cp=2"], 4)])
def test_layout_needing_more_ranks_is_refused_in_one_process(tmp_path, capsys, degrees, need):
    out = tmp_path / "run"
    assert main(_args(tmp_path, out, *degrees)) == 2
    err = capsys.readouterr().err
    assert f"needs {need} ranks" in err and f"--nproc-per-node {need}" in err
    assert not out.exists()  # nothing written


def test_refused_run_leaves_the_earlier_run_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tmp_path, out)) == 0
    before = {p: (out / p).read_bytes() for p in ("config.yaml", "training.jsonl", "latest")}
    assert main(_args(tmp_path, out, "--optimizer.lr=0.5")) == 2  # no resume, no overwrite
    assert "already holds a run" in capsys.readouterr().err
    assert {p: (out / p).read_bytes() for p in before} == before
    assert not (out / LOCK_NAME).exists()  # released on exit


def test_a_held_run_folder_refuses_a_second_run(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        (out / LOCK_NAME).write_text(f"{socket.gethostname()} {holder.pid}\n")
        assert main(_args(tmp_path, out)) == 2
        err = capsys.readouterr().err
        assert str(out) in err and f"process {holder.pid}" in err
        assert sorted(os.listdir(out)) == [LOCK_NAME]  # nothing else written
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is stale and the run goes ahead
    assert main(_args(tmp_path, out)) == 0
    assert not (out / LOCK_NAME).exists() and (out / "latest").exists()


def test_run_lock_api(tmp_path):
    with RunLock(tmp_path / "r") as lock:
        assert (tmp_path / "r" / LOCK_NAME).read_text().split()[1] == str(os.getpid())
        with pytest.raises(RunFolderBusy, match="in use by process"):
            RunLock(tmp_path / "r").acquire()
        assert lock.held
    assert not (tmp_path / "r" / LOCK_NAME).exists()


def test_diverging_run_stops_without_export_and_stays_resumable(tmp_path, capsys):
    out = tmp_path / "run"
    args = _args(tmp_path, out, "--training.ckpt_every_steps=1", "--checkpoint.keep_last=2",
                 "--training.grad_clip=null")
    args = [a for a in args if not a.startswith("--training.max_steps")]
    # two good steps, then a learning rate that sends the weights to inf
    assert main(args + ["--training.max_steps=2"]) == 0
    code = main(args + ["--training.max_steps=20", "--checkpoint.resume=auto",
                        "--optimizer.lr=1e30", "--training.max_consecutive_skipped_steps=3"])
    err = capsys.readouterr().err
    assert code == 3 and "training diverged: 3 consecutive steps" in err
    assert "max_consecutive_skipped_steps" in err
    recs = [json.loads(line) for line in open(out / "training.jsonl")]
    assert [r["skipped_steps"] for r in recs[-3:]] == [1, 2, 3]
    assert not any((p / "hf").exists() for p in out.glob("step_*") if p.name != "step_2")
    # step 3's update sent the weights to inf (steps 4..6 skipped): latest goes back to step_2
    assert "latest` now names" in err and "step_3 may hold the diverged weights" in err
    assert (out / "latest").read_text().strip() == "step_2"
    assert not (out / LOCK_NAME).exists()
    # the last checkpoint resumes
    assert main(args + ["--training.max_steps=6", "--checkpoint.resume=auto"]) == 0
    assert (out / "step_6" / "hf").is_dir()


def test_resume_auto_into_an_empty_folder_says_so(tmp_path, caplog):
    """A misspelt run folder under checkpoint.resume=auto does not start from scratch unnoticed."""
    import logging

    from hybridtrain.config import build_config
    from hybridtrain.recipes.finetune import _check_run_folder

    out = tmp_path / "no_such_run"
    cfg = build_config({"checkpoint": {"dir": str(out), "resume": "auto"}})
    with caplog.at_level(logging.INFO, logger="hybridtrain.recipes.finetune"):
        assert _check_run_folder(cfg, str(out)) == (None, False)
    lines = [r.getMessage() for r in caplog.records if "resume=auto" in r.getMessage()]
    assert lines == [f"checkpoint.resume=auto: {out} holds no checkpoint; starting a new run"]


@pytest.mark.parametrize("print_config", [False, True])
def test_lora_without_targets_is_refused_naming_the_keys(tmp_path, capsys, print_config):
    """`match_all_linear: false` and no `target_modules` adapts nothing the recipe names: refused
    at load time (also by --print-config), not read as "adapt every layer"."""
    path = tmp_path / "recipe.yaml"
    recipe = tiny_recipe(peft={"dim": 4, "match_all_linear": False})
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    line = path.read_text().splitlines().index("  match_all_linear: false") + 1
    out = tmp_path / "run"
    args = ["finetune", "-c", str(path), f"--checkpoint.dir={out}", "--training.max_steps=1"]
    assert main(args + (["--print-config"] if print_config else [])) == 2
    err = capsys.readouterr().err
    assert "peft.match_all_linear is false and peft.target_modules is empty" in err
    assert f"({path}:{line})" in err and not out.exists()
    # either key says what to adapt
    recipe["peft"] = {"dim": 4, "target_modules": ["q_proj"]}
    path.write_text(yaml.safe_dump(recipe))
    assert main(["finetune", "-c", str(path), "--print-config"]) == 0


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_checkpoint_dir_that_is_a_file_is_refused_naming_the_key(tmp_path, capsys, where):
    (tmp_path / "notes.txt").write_text("mine\n")
    out = tmp_path / "notes.txt" if where == "file" else tmp_path / "notes.txt" / "run"
    assert main(_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.dir: {out}" in err and "not a folder" in err
    assert "Traceback" not in err and "FileExistsError" not in err
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("pointer", ["../elsewhere/step_9", "ABSOLUTE", "step_9", "final"])
def test_latest_that_leads_out_of_the_run_folder_is_refused(tmp_path, pointer):
    """``latest`` names a step_N folder of its run folder: a relative path out, an absolute
    path, a step_N that is a link out, or any other name is refused before anything is read."""
    from hybridtrain.training.checkpoint import Checkpointer

    elsewhere = tmp_path / "elsewhere" / "step_9"
    elsewhere.mkdir(parents=True)
    (elsewhere / "trainer_state.json").write_text("{}")
    run = tmp_path / "run"
    run.mkdir()
    if pointer == "ABSOLUTE":
        pointer = str(elsewhere)
    if pointer == "step_9":
        (run / "step_9").symlink_to(elsewhere, target_is_directory=True)
    (run / "latest").write_text(pointer + "\n")
    from hybridtrain.recipes.generate import resolve_export
    from hybridtrain.training.checkpoint_reader import convert

    folder = Checkpointer(str(run))
    refused = r"latest names .*not a step_N folder of the run folder .* \(it would lead out of it\)"
    for resume in ("auto", str(run)):
        with pytest.raises(ValueError, match=refused):
            folder.resolve_resume(resume)
    with pytest.raises(ValueError, match=refused):  # generate / evaluate --model RUN_DIR
        resolve_export(str(run))
    with pytest.raises(ValueError, match=refused):  # hybridtrain convert RUN_DIR OUT
        convert(str(run), str(tmp_path / "out"))


def test_a_disk_turned_read_only_mid_run_is_reported_against_the_failed_write(tmp_path, capsys,
                                                                              monkeypatch):
    """The second checkpoint and then every removal fail with EROFS: the error names the
    checkpoint being written, not the lock that could not be removed on the way out."""
    import errno

    from hybridtrain import runfolder
    from hybridtrain.training import checkpoint

    real_save, real_remove = checkpoint.dcp_save, os.remove
    read_only = []

    def dcp_save(tensors, path):
        if ".step_2.tmp" in path:
            read_only.append(True)
        if read_only:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_save(tensors, path)

    def remove(path, *a, **kw):
        if read_only:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_remove(path, *a, **kw)

    monkeypatch.setattr(checkpoint, "dcp_save", dcp_save)
    monkeypatch.setattr(runfolder.os, "remove", remove)
    out = tmp_path / "run"
    assert main(_args(tmp_path, out, "--training.ckpt_every_steps=1")) == 2
    err = capsys.readouterr().err
    assert f"hybridtrain: error: read-only file system while writing checkpoint {out}/step_2 " \
        f"({out}/.step_2.tmp)" in err
    assert f"could not remove the run folder's lock {out}/{LOCK_NAME}" in err
    assert "Traceback" not in err
    assert (out / "latest").read_text().strip() == "step_1"
