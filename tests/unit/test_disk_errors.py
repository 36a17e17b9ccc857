"""A full or read-only disk while a run writes: a clear error naming the path, and no partial
checkpoint (``.step_N.tmp``) left behind to fill the disk further. A full disk is a file size
limit (``RLIMIT_FSIZE``, set in the child process that runs the CLI: writes past it fail with
EFBIG) or ``/dev/full`` (every write fails with ENOSPC)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.helpers.recipes import tiny_recipe

from hybridtrain.cli import main
from hybridtrain.fileio import WriteError, append_text, atomic_write
from hybridtrain.runfolder import LOCK_NAME

REPO = Path(__file__).resolve().parents[2]

# each run: `hybridtrain finetune` under a file size limit (the soft limit, lowered per run), its
# exit status printed after its stderr
LIMITED = """import resource, sys
from hybridtrain.cli import main
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
for limit, out in zip(sys.argv[1::2], sys.argv[2::2]):
    print("=== run", file=sys.stderr, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), hard))
    rc = main([*sys.argv[-1].split(), "--checkpoint.dir=" + out])
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    print("rc", rc, file=sys.stderr, flush=True)
"""


@pytest.fixture(scope="module")
def limited_runs(tmp_path_factory) -> dict[int, tuple[Path, int, str]]:
    """`hybridtrain finetune` of one step with no file larger than 200 kB (the logs fit, the
    checkpoint's shard does not) and 1 kB (config.yaml is larger), run one after the other in
    one child process (one torch import): per limit, (output folder, exit status, stderr)."""
    tmp = tmp_path_factory.mktemp("disk")
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe()))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    args = (f"finetune -c {recipe} --training.max_steps=1 --training.global_batch_size=2 "
            "--metrics.progress_bar=false")
    limits = (200_000, 1000)
    outs = [tmp / f"run{limit}" for limit in limits]
    res = subprocess.run([sys.executable, "-c", LIMITED,
                          *[str(x) for pair in zip(limits, outs) for x in pair], args],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = res.stderr.split("=== run\n")[1:]
    assert len(runs) == len(limits), res.stderr[-3000:]
    return {limit: (out, int(err.rstrip().rsplit("rc ", 1)[1]), err)
            for limit, out, err in zip(limits, outs, runs)}


def test_full_disk_while_checkpointing_leaves_no_partial_checkpoint(limited_runs):
    out, rc, err = limited_runs[200_000]  # the logs fit, the checkpoint's shard does not
    assert rc == 2, err[-3000:]
    assert (f"hybridtrain: error: file too large while writing checkpoint {out}/step_1 "
            f"({out}/.step_1.tmp); a file size limit (ulimit -f) is in force; the partial "
            "checkpoint was removed") in err
    assert "Traceback" not in err
    assert sorted(os.listdir(out)) == ["config.yaml", "training.jsonl"]  # no .step_1.tmp, lock


def test_full_disk_while_writing_the_recipe_names_the_file(limited_runs):
    out, rc, err = limited_runs[1000]  # config.yaml is larger
    assert rc == 2, err[-3000:]
    assert f"hybridtrain: error: file too large while writing file ({out}/config.yaml)" in err
    assert os.listdir(out) == []  # no temporary file, no lock


def test_no_space_left_while_logging_names_the_log():
    with pytest.raises(WriteError, match=r"^no space left on device while writing log "
                                         r"\(/dev/full\); free some space"):
        append_text("/dev/full", "x" * 10_000)


def test_read_only_folders(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        try:
            (ro / "probe").touch()
        except PermissionError:
            pass
        else:  # root (os.geteuid() == 0, with CAP_DAC_OVERRIDE) writes into read-only folders
            pytest.skip("this process writes into read-only folders (root)")
        with pytest.raises(WriteError, match=rf"permission denied while writing file "
                                             rf"\({ro}/f\)"):
            atomic_write(ro / "f", "x")
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(tiny_recipe()))
        assert main(["finetune", "-c", str(recipe), f"--checkpoint.dir={ro}",
                     "--training.max_steps=1"]) == 2
        err = capsys.readouterr().err
        assert f"cannot lock checkpoint.dir {ro}: Permission denied" in err
        assert os.listdir(ro) == [] and not (ro / LOCK_NAME).exists()
    finally:
        ro.chmod(0o755)
