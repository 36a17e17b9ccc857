"""Sequence parallelism (``distributed.sequence_parallel`` with ``tp: 2``) through the recipe's
builder and trainer against the single-process run, packed and unpacked: per-step losses and
gradient norms, final weights and validation loss within 1e-5 relative (also with activation
checkpointing); the residual stream between the blocks holds half of every row on each rank."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed
from tests.distributed.test_tensor_parallel import _check, _max_rel


def _residual_lengths(model, row_len: int) -> list[int]:
    """The sequence length every block receives (and returns) on this rank for one row."""
    seen = []
    hooks = [b.register_forward_hook(lambda m, args, out: seen.append((args[0].shape[1], out.shape[1])))
             for b in model.backbone.layers.values()]
    with torch.no_grad():
        model(torch.randint(0, 100, (1, row_len)))
    for h in hooks:
        h.remove()
    return seen


def _sp_group(rank, world):
    out = {packed: pu.run_layout({"tp": 2, "sp": True}, world, packed) for packed in (False, True)}
    out["ac"] = pu.run_layout({"tp": 2, "sp": True}, world, False, ac=True)[0]  # (wrapped names)
    b, _ = pu.build({"tp": 2, "sp": True}, world)
    out["lengths"] = _residual_lengths(b.model, 15)  # uneven: 8 + 7 tokens
    return out


@pytest.mark.distributed
def test_tp2_sequence_parallel_matches_single_process():
    torch.set_num_threads(1)
    ref = {packed: pu.reference(packed) for packed in (False, True)}
    res = run_distributed(_sp_group, 2)
    assert set(res[0]["lengths"]) == {(8, 8)} and set(res[1]["lengths"]) == {(7, 7)}
    for packed in (False, True):
        _check(f"tp2+sp {'packed' if packed else 'unpacked'}", res[0][packed], ref[packed])
    assert _max_rel(res[0]["ac"], ref[False][0]) <= 1e-5, (res[0]["ac"], ref[False][0])


OTHERS = {"pp2": {"pp": 2}, "cp2": {"cp": 2}}


def _sp_with_group(rank, world):
    return {name: pu.run_layout({"tp": 2, "sp": True, **other}, world, True)
            for name, other in OTHERS.items()}


@pytest.fixture(scope="module")
def sp_with_others():
    """Rank 0's packed runs of tp2 + sp with each of ``OTHERS``, in one 4-rank group."""
    torch.set_num_threads(1)
    return run_distributed(_sp_with_group, 4)[0]


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(OTHERS))
def test_tp2_sequence_parallel_with_pp_or_cp_matches_single_process(name, sp_with_others):
    """Pipeline stages pass whole rows (each stage's blocks hold their part); under context
    parallelism the tp ranks split this rank's slice of the rows."""
    _check(f"tp2 x {name} +sp packed", sp_with_others[name], pu.reference(True))
