"""`hybridtrain dpo` / `grpo` stopped by a signal (exit 75, lock released, `step_k` saved) and
resumed with `--checkpoint.resume=auto` (or a `step_N` path) log exactly the uninterrupted run's
steps: the same pairs / prompts, the same sampled completions, the same losses, rewards and
learning rates, and no line twice. The signal is sent once step 2 is logged (from the run's own
thread: no timing)."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest
import yaml
from tests.unit.test_rl_recipes import rl_recipe, signal_after_step

from hybridtrain.cli import main
from hybridtrain.runfolder import LOCK_NAME
from hybridtrain.training.preemption import EXIT_PREEMPTED

STEPS = 4
STOP = 2  # the step after which the signal comes
# what must match the uninterrupted run's, step by step
COMPARED = {"dpo": ("loss", "grad_norm", "lr", "accuracy", "reward_margin"),
            "grpo": ("loss", "grad_norm", "lr", "reward", "reward_std", "accuracy", "kl", "ratio")}


def _write_recipe(tmp_path, name: str) -> str:
    cfg = rl_recipe(tmp_path, name, num_pairs=16, max_new_tokens=3, updates_per_rollout=2)
    cfg["training"]["max_steps"] = STEPS
    cfg["lr_scheduler"] = {"lr_decay_style": "cosine", "lr_warmup_steps": 2, "lr_decay_steps": 20}
    cfg["metrics"]["plot"] = False
    cfg["checkpoint"]["save_hf_at_end"] = False
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _run(name: str, recipe: str, out, *extra) -> int:
    return main([name, "-c", recipe, f"--checkpoint.dir={out}", *extra])


def _records(out) -> list[dict]:
    return [json.loads(line) for line in open(out / "training.jsonl")]


def _compared(name: str, records: list[dict]) -> list[tuple]:
    return [(r["step"], *(r[k] for k in COMPARED[name])) for r in records]


@pytest.fixture(scope="module", params=["dpo", "grpo"])
def uninterrupted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    recipe = _write_recipe(tmp, request.param)
    assert _run(request.param, recipe, tmp / "run") == 0
    return request.param, recipe, _records(tmp / "run")


def test_a_stopped_run_resumes_exactly(tmp_path, capsys, monkeypatch, uninterrupted):
    name, recipe, whole = uninterrupted
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        signal_after_step(m, signal.SIGUSR1, STOP)
        assert _run(name, recipe, out) == EXIT_PREEMPTED
    assert f"SIGUSR1 received: {name} stopped after step {STOP} of {STEPS}; saved " \
        f"{out}/step_{STOP}" in capsys.readouterr().err
    assert (out / "latest").read_text().strip() == f"step_{STOP}"
    assert not (out / LOCK_NAME).exists()  # released with the stop
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert _run(name, recipe, out, "--checkpoint.resume=auto") == 0
    got = _records(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # no line twice
    assert _compared(name, got) == _compared(name, whole)
    assert (out / "latest").read_text().strip() == f"step_{STEPS}"
    assert not (out / LOCK_NAME).exists()


@pytest.mark.parametrize("uninterrupted", ["grpo"], indirect=True)  # the path is RLRun's
def test_resume_from_a_step_folder_redoes_the_steps_after_it(tmp_path, uninterrupted):
    """Periodic checkpoints (``training.ckpt_every_steps``) change nothing in the run; resuming
    the finished run from its ``step_1`` drops the lines after step 1 and redoes them."""
    name, recipe, whole = uninterrupted
    out = tmp_path / "run"
    assert _run(name, recipe, out, "--training.ckpt_every_steps=1") == 0
    assert sorted(p.name for p in out.glob("step_*")) == [f"step_{i}" for i in range(1, STEPS + 1)]
    assert _compared(name, _records(out)) == _compared(name, whole)
    assert _run(name, recipe, out, f"--checkpoint.resume={out}/step_1") == 0
    assert _compared(name, _records(out)) == _compared(name, whole)
    assert (out / "latest").read_text().strip() == f"step_{STEPS}"


def test_resume_refuses_another_recipes_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "step_4").mkdir(parents=True)
    (out / "step_4" / "trainer_state.json").write_text(json.dumps({"step": 4, "extra": {}}))
    (out / "latest").write_text("step_4\n")
    recipe = _write_recipe(tmp_path, "grpo")
    assert _run("grpo", recipe, out, "--checkpoint.resume=auto") == 2
    err = capsys.readouterr().err
    assert f"{out}/step_4 is not a checkpoint of a `hybridtrain grpo` run (`hybridtrain " \
        "finetune` wrote it" in err
    assert "set model.local_dir to its export" in err
    assert not (out / LOCK_NAME).exists()


def test_a_locked_run_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(f"{socket.gethostname()} {os.getpid()}\n")  # a live holder
    assert _run("grpo", _write_recipe(tmp_path, "grpo"), out) == 2
    assert f"checkpoint.dir {out} is in use by process {os.getpid()}" in capsys.readouterr().err
    assert (out / LOCK_NAME).exists()  # not ours to remove
