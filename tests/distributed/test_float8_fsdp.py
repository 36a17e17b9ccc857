"""``training.float8`` under FSDP2 (2 ranks, gloo): ``tensorwise`` weights are all-gathered in
float8 (each shard cast with the whole weight's scale, precomputed after each optimizer step),
which gives the bytes of casting after a high-precision gather, so the run matches the
single-process float8 run as closely as the high-precision FSDP2 run does (only the
gradients' reduction order differs)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import parity
from tests.helpers.distributed import run_distributed

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.timeout(300)

FLOAT8 = {"float8": "tensorwise", "float8_filter": []}  # every aligned Linear of the blocks


def _train(layout: dict, world: int):
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    b, trainer = parity.build(layout, world, training=FLOAT8)
    linears = [m for m in b.model.modules() if type(m).__name__ == "Float8Linear"]
    losses, norms = parity.train(b, trainer)
    local = [getattr(m.weight, "_local_tensor", m.weight) for m in linears]  # (as torchao reads it)
    return {"losses": losses, "norms": norms, "converted": len(linears),
            "float8_gather": sum(type(w).__name__ == "WeightWithDynamicFloat8CastTensor" for w in local),
            "precomputed": sum(getattr(w, "_precomputed_scale", None) is not None for w in local),
            "plain_state": all(type(t) in (torch.Tensor, DTensor) and
                               type(t.to_local() if isinstance(t, DTensor) else t) is torch.Tensor
                               for t in b.model.state_dict().values())}


def _ranks(rank: int, world: int):
    return _train({"dp_shard": 2}, world)


def test_float8_under_fsdp2_matches_one_process():
    ref = _train({}, 1)
    assert ref["converted"] > 0 and ref["float8_gather"] == ref["precomputed"] == 0
    for r in run_distributed(_ranks, 2, timeout=240):
        assert r["converted"] == r["float8_gather"] == r["precomputed"] == ref["converted"]
        assert r["plain_state"]
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-4)
