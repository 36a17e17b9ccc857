"""Pipeline parallelism of the colocated vision-language model: ``distributed.pp=2`` with the
vision encoder + projector on the first stage (they feed its embeddings) and the language
model's layers split over the stages by the spec's pipeline split. The tiny VLM through the
recipe's builder and trainer, 3 AdamW steps of mixed image / text-only batches (a micro-batch
may hold no image), unpacked rows, and packed rows (several images per row) in stage 1
(``freeze: [vision, language]``: the second stage holds nothing trainable, so its rank has no
optimizer): per-step loss and gradient norm within 1e-5 relative of the single process, final
weights within 1e-5, validation loss."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import vlm
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.timeout(600)

CASES = {"pp2": (False, ()), "pp2_packed_stage1": (True, ("vision", "language"))}


def _group(rank, world, tmp):
    return {name: vlm.run(tmp, {"pp": 2}, world, packed, freeze)
            for name, (packed, freeze) in CASES.items()}


@pytest.fixture(scope="module")
def results(vlm_dir):
    torch.set_num_threads(1)
    tmp = vlm_dir
    ref = {name: vlm.reference(tmp, packed, freeze) for name, (packed, freeze) in CASES.items()}
    return ref, run_distributed(_group, 2, tmp, timeout=500), tmp


def _check(ref, ranks, name):
    got = ranks[0]
    assert all(r[0] == got[0] and r[3] == got[3] for r in ranks)  # every stage agrees
    vlm.assert_run_matches(got, ref, name)


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_parity(results, name):
    _check(results[0][name], [r[name] for r in results[1]], name)


def _pp_fsdp(rank, world, tmp):
    return vlm.run(tmp, {"pp": 2, "dp_shard": 2}, world)


def test_pipeline_with_fsdp_parity(results):
    """pp 2 x FSDP2 2 on 4 ranks: the first stage's data-parallel ranks run the vision path in
    step also when one of them has no image (validation included)."""
    ranks = run_distributed(_pp_fsdp, 4, results[2], timeout=500)
    _check(results[0]["pp2"], ranks, "pp2 x fsdp2")
