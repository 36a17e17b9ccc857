"""Stage 1 (``freeze: [vision, language]``: the projector alone trains) through the finetune
recipe's ``run`` under ``distributed.encoder_ranks=2`` on 4 ranks: the same per-step losses as
the one-process run, the exported vision encoder and language model bit-identical to their
initial weights, and no optimizer (so no optimizer state in the checkpoint) for the modules
with nothing trainable on their ranks: the language model's ranks have none at all."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import vlm
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.timeout(600)

STEPS = 3
FREEZE = ("vision", "language")


def _recipe(tmp, out, layout):
    return vlm.vlm_recipe(tmp, layout, freeze=FREEZE,
                          training={"max_steps": STEPS, "ckpt_every_steps": STEPS},
                          checkpoint={"dir": out, "save_hf_at_end": True})


def _finetune(rank, world, tmp, out, layout):
    from hybridtrain.recipes.finetune import run

    return run(_recipe(tmp, out, layout))["checkpoint"]


def _losses(out):
    with open(os.path.join(out, "training.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = str(tmp_path_factory.mktemp("vlm_stage1"))
    ref = _finetune(0, 1, tmp, f"{tmp}/colocated", {})
    got = run_distributed(_finetune, 4, tmp, f"{tmp}/hetero", {"encoder_ranks": 2},
                          timeout=500)[0]
    return tmp, ref, got


def test_losses_match_one_process(runs):
    tmp, _, _ = runs
    ref, got = _losses(f"{tmp}/colocated"), _losses(f"{tmp}/hetero")
    assert len(got) == len(ref) == STEPS
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    print(f"stage 1, 2+2 through the recipe: loss rel {rel:.2e}")
    assert rel <= 1e-5


def test_frozen_modules_unchanged_and_without_optimizer_state(runs):
    from torch.distributed.checkpoint import FileSystemReader

    from hybridtrain.models.nemotron_vlm import NemotronVLMForConditionalGeneration
    from hybridtrain.training.builder import build

    tmp, _, ckpt = runs
    init = build(_recipe(tmp, f"{tmp}/init", {}), "cpu", data=False).model.state_dict()
    final = NemotronVLMForConditionalGeneration.from_pretrained(f"{ckpt}/hf").state_dict()
    assert final.keys() == init.keys()
    for k, v in init.items():
        same = torch.equal(final[k], v)
        assert same == (not k.startswith("projector.")), k  # only the projector moved
    keys = FileSystemReader(f"{ckpt}/dcp").read_metadata().state_dict_metadata
    optim = {k.split(".", 2)[2] for k in keys if k.startswith("optim.state.")}
    assert optim and all(k.startswith("projector.") for k in optim), sorted(optim)[:5]
    assert {k for k in keys if k.startswith("model.language_model.")}  # its weights are saved
