"""``distributed.encoder_ranks`` with the language model laid out by its own degrees on the other
ranks, through the recipe's builder and trainer: vision encoder + projector on ranks 0..E-1,
the language model pipelined (``pp=2``), FSDP2-sharded (``dp_shard=2``) or expert-parallel
(``ep=2``) over the rest. Three AdamW steps of mixed image / text-only batches match the single
process (per-step loss and gradient norm within 1e-5 relative, final weights within 1e-5,
validation loss); a checkpoint of the sharded / pipelined run resumes colocated and the
colocated one resumes under the layout."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import vlm
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.timeout(600)

SAVE_AT = vlm.parity.SAVE_AT
# name -> (encoder ranks, world size, the language model's degrees)
LAYOUTS = {"2+pp2": (2, 4, {"pp": 2}), "1+fsdp2": (1, 3, {"dp_shard": 2}),
           "1+ep2": (1, 3, {"dp_shard": 2, "ep": 2})}


@pytest.fixture(scope="module")
def reference(vlm_dir, vlm_ckpt):
    torch.set_num_threads(1)
    vlm.colocated_checkpoint(vlm_dir, vlm_ckpt)
    return vlm_dir, vlm_ckpt, vlm.reference(vlm_dir)


def _group(rank, world, tmp, ckpt, name, layout):
    path = f"{ckpt}/{name}"
    return {"run": vlm.run(tmp, layout, world),
            "save": vlm.train_and_save(tmp, layout, world, path, SAVE_AT),
            "resume": vlm.resume_and_train(tmp, layout, world, f"{ckpt}/colocated")}


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hetero_language_model_layout(reference, name):
    tmp, ckpt, ref = reference
    enc, world, degrees = LAYOUTS[name]
    layout = {"encoder_ranks": enc, **degrees}
    out = run_distributed(_group, world, tmp, ckpt, name, layout, timeout=500)
    losses, _, _, norms = out[0]["run"]
    assert all(r["run"][0] == losses and r["run"][3] == norms for r in out)  # every rank agrees
    vlm.assert_run_matches(out[0]["run"], ref, name)
    # checkpoints: the layout's resumes colocated, the colocated one resumes under the layout
    assert _rel(out[0]["save"], ref[0][:SAVE_AT]) <= 1e-5
    resumed = vlm.resume_and_train(tmp, None, 1, f"{ckpt}/{name}")
    assert _rel(resumed, ref[0][SAVE_AT:]) <= 1e-5
    assert _rel(out[0]["resume"], ref[0][SAVE_AT:]) <= 1e-5
