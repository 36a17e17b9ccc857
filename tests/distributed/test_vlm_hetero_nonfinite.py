"""``distributed.encoder_ranks``: a step whose gradient is not finite on one encoder rank only (the
gradient of its projector's output; FSDP2's reduction then carries it into the encoder's shards)
is skipped on every rank together (the global norm is the same everywhere): no rank's weights or
optimizer move, the LR schedule does not advance, ``skipped_steps`` grows on all ranks, and the
next step trains again."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import parity, vlm
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.timeout(600)


def _infinite_output_gradient(module, args, out) -> None:
    out.register_hook(lambda g: g * float("inf"))


def _ranks(rank: int, world: int, tmp: str):
    torch.set_num_threads(1)
    b, trainer = vlm.build(tmp, {"encoder_ranks": 2}, world, lr_scheduler={"lr_warmup_steps": 4})
    records = [trainer.train_one_step(parity.micro_batches(b, 0))]
    before = parity.full_state(b.model)
    hook = None
    if rank == 0:  # the gradient of one encoder rank's projector output turns infinite
        hook = b.model.projector.register_forward_hook(_infinite_output_gradient)
    records.append(trainer.train_one_step(parity.micro_batches(b, 1)))
    unchanged = all(torch.equal(before[k], v) for k, v in parity.full_state(b.model).items())
    if hook is not None:
        hook.remove()
    records.append(trainer.train_one_step(parity.micro_batches(b, 2)))
    return {"records": [{k: r[k] for k in ("loss", "grad_norm", "skipped_steps", "lr")} for r in records],
            "unchanged": unchanged, "owns": len(before)}


def test_nonfinite_step_on_one_encoder_rank_is_skipped_everywhere(tmp_path):
    tmp = str(tmp_path)
    vlm.hetero_data(tmp)
    ranks = run_distributed(_ranks, 4, tmp, timeout=500)
    for rank, r in enumerate(ranks):
        first, bad, after = r["records"]
        assert r["owns"] > 0, rank
        assert math.isfinite(first["grad_norm"]) and first["skipped_steps"] == 0, (rank, first)
        assert not math.isfinite(bad["grad_norm"]) and bad["skipped_steps"] == 1, (rank, bad)
        assert r["unchanged"], f"rank {rank}: weights moved in the skipped step"
        assert bad["lr"] != first["lr"]  # the schedule moves every step (warmup) ...
        assert after["lr"] == bad["lr"], (rank, after["lr"], bad["lr"])  # ... but not on a skip
        assert math.isfinite(after["grad_norm"]) and after["skipped_steps"] == 1, (rank, after)
    assert len({r["records"][2]["loss"] for r in ranks}) == 1  # one loss on every rank
