"""``distributed.encoder_ranks`` through the recipe's builder and trainer: the tiny VLM with its
ViT + projector on ranks 0..E-1 and the language model on the others trains like the single
process (per-step loss and gradient norm within 1e-5 relative, final weights within 1e-5,
validation loss), and checkpoints cross between the heterogeneous and the colocated layout in
both directions (per-module keys on disjoint ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import vlm
from tests.helpers.distributed import run_distributed

# several spawned groups of 3-4 ranks in one fixture: above the suite's 300 s on a loaded box
pytestmark = pytest.mark.timeout(1200)

LAYOUTS = {"2+2": (2, 4), "2+1": (2, 3)}
SAVE_AT = vlm.parity.SAVE_AT


@pytest.fixture(scope="module")
def results(vlm_dir, vlm_ckpt):
    torch.set_num_threads(1)
    tmp, ckpt = vlm_dir, vlm_ckpt
    ref = vlm.reference(tmp)
    vlm.colocated_checkpoint(tmp, ckpt)
    out = {name: run_distributed(vlm.hetero_group, world, tmp, enc, ckpt, timeout=600)
           for name, (enc, world) in LAYOUTS.items()}
    resumed = {name: vlm.resume_and_train(tmp, None, 1, f"{ckpt}/hetero{enc}")
               for name, (enc, _) in LAYOUTS.items()}
    return ref, out, resumed


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hetero_trainer_parity(results, name):
    ref, out, _ = results
    ranks = [r["run"] for r in out[name]]
    assert all(r[0] == ranks[0][0] and r[3] == ranks[0][3] for r in ranks)  # every rank agrees
    vlm.assert_run_matches(ranks[0], ref, name)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpoints_cross_hetero_and_colocated(results, name):
    ref, out, resumed = results
    assert _rel(out[name][0]["save"], ref[0][:SAVE_AT]) <= 1e-5
    assert _rel(resumed[name], ref[0][SAVE_AT:]) <= 1e-5       # hetero -> colocated
    assert _rel(out[name][0]["resume"], ref[0][SAVE_AT:]) <= 1e-5  # colocated -> hetero
