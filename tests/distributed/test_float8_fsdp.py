"""``training.float8`` under FSDP2 (2 ranks, gloo): the converted layers' weights are sharded and
all-gathered in high precision, so the run matches the single-process float8 run."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import parity
from tests.helpers.distributed import run_distributed

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.timeout(300)

FLOAT8 = {"float8": "tensorwise", "float8_filter": []}  # every aligned Linear of the blocks


def _train(layout: dict, world: int):
    torch.set_num_threads(1)
    b, trainer = parity.build(layout, world, training=FLOAT8)
    converted = sum(type(m).__name__ == "Float8Linear" for m in b.model.modules())
    losses, norms = parity.train(b, trainer)
    return {"losses": losses, "norms": norms, "converted": converted}


def _ranks(rank: int, world: int):
    return _train({"dp_shard": 2}, world)


def test_float8_under_fsdp2_matches_one_process():
    ref = _train({}, 1)
    assert ref["converted"] > 0
    for r in run_distributed(_ranks, 2, timeout=240):
        assert r["converted"] == ref["converted"]
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-4)
