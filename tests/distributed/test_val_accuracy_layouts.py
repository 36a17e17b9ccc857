"""``training.val_accuracy`` under the layouts that compute the logits away from the data: a
pipeline (the last stage's logits, packed rows), an encoder on its own ranks (the language
lanes' logits, through the bridge) and both, on the tiny VLM trained a few steps in one process
(its HF export, loaded by each layout); context parallelism (each rank predicts a slice of every
row) on the tiny language model trained through ``finetune``'s ``run``.
Each layout reports the same answer and token accuracy as one process (exact counts) and the
same validation loss."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import vlm
from tests.helpers.distributed import run_distributed
from tests.helpers.recipes import tiny_recipe

pytestmark = pytest.mark.timeout(600)

# name -> (the distributed section, world size)
LAYOUTS = {"pp2": ({"pp": 2}, 2), "2+2": ({"encoder_ranks": 2}, 4),
           "1+pp2": ({"encoder_ranks": 1, "pp": 2}, 3)}


def _validate(rank, world, tmp, hf, layout):
    _, trainer = vlm.build(tmp, layout, world, packed=True, model={"local_dir": hf},
                           training={"val_accuracy": True})
    rec = trainer.validate()
    return {k: rec[k] for k in ("val_loss", "answer_accuracy", "token_accuracy", "num_samples")}


@pytest.fixture(scope="module")
def trained(vlm_dir, tmp_path_factory):
    """A one-process run of 6 steps at a high learning rate (its HF export) and its validation."""
    from hybridtrain.recipes.finetune import run

    torch.set_num_threads(1)
    out = str(tmp_path_factory.mktemp("val_accuracy"))
    recipe = vlm.vlm_recipe(vlm_dir, packed=True, training={"max_steps": 6},
                            optimizer={"lr": 5e-3}, checkpoint={"dir": out, "save_hf_at_end": True})
    hf = run(recipe)["checkpoint"] + "/hf"
    return hf, _validate(0, 1, vlm_dir, hf, None)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_val_accuracy_under_the_layout_is_one_process(vlm_dir, trained, name):
    hf, ref = trained
    assert ref["token_accuracy"] > 0.1  # the counts compared below are not all zero
    layout, world = LAYOUTS[name]
    got = run_distributed(_validate, world, vlm_dir, hf, layout, timeout=500)
    for rec in got:  # every rank logs the same record
        assert rec["num_samples"] == ref["num_samples"]
        assert rec["answer_accuracy"] == ref["answer_accuracy"], (name, rec, ref)
        assert rec["token_accuracy"] == ref["token_accuracy"], (name, rec, ref)
        assert abs(rec["val_loss"] - ref["val_loss"]) <= 1e-5 * ref["val_loss"], (name, rec, ref)


# -- the language model under context parallelism: each rank predicts a slice of every row ------
def _lm_recipe(out, layout):
    """The tiny language model on packed rows of two token ids: a few steps at a high
    learning rate make its predictions partly right."""
    data = {"_target_": "tests.helpers.data.sft_dataset", "vocab_size": 3, "min_len": 4,
            "max_len": 16}
    return tiny_recipe(dataset={**data, "n": 160}, validation_dataset={**data, "n": 16, "seed": 99},
                       packing={"enabled": True, "pack_size": 32}, distributed=layout,
                       training={"max_steps": 6, "val_accuracy": True, "val_every_steps": 6,
                                 "ckpt_every_steps": 100},
                       optimizer={"lr": 1e-2}, checkpoint={"dir": out, "enabled": False})


def _lm_validation(rank, world, out, layout):
    from hybridtrain.recipes.finetune import run

    run(_lm_recipe(out, layout))
    with open(f"{out}/validation.jsonl") as f:
        return [json.loads(line) for line in f]


def test_val_accuracy_under_context_parallelism_is_one_process(tmp_path):
    """An answer that spans two ranks' slices is one answer (its slices' predictions joined)."""
    torch.set_num_threads(1)
    ref = _lm_validation(0, 1, str(tmp_path / "one"), {})
    assert ref[-1]["token_accuracy"] > 0.1 and ref[-1]["answer_accuracy"] > 0
    got = run_distributed(_lm_validation, 2, str(tmp_path / "cp2"), {"cp": 2}, timeout=300)[0]
    for r, g in zip(ref, got, strict=True):
        assert (g["answer_accuracy"], g["token_accuracy"]) == (
            r["answer_accuracy"], r["token_accuracy"]), (g, r)
        assert abs(g["val_loss"] - r["val_loss"]) <= 1e-5 * r["val_loss"]
