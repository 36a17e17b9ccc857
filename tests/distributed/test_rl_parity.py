"""The RL Policy under parallel layouts equals the single process (fp32, gloo, 2 and 4 ranks).

Every layout runs the same sequence on the same global batch (every rank passes the whole
batch): log-probs unpacked and packed, top-k logits, one ``train`` step with each loss (NLL
unpacked; clipped PG with KL, packed; DPO, micro-batches of one pair), the log-probs after the
three steps, and the Hub-named weights. Per-step losses and gradient norms within 1e-5 relative,
log-probs within 1e-5 absolute of the single-process run. Under tensor parallelism the tp ranks
see the same rows (they are not data-parallel ranks) and the head is vocab-parallel. Under
context parallelism each rank runs its slice of every (packed or unpacked) micro-batch and the
per-token values are gathered back to whole rows (its own fixture: ``-k cp``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.unit.test_rl_policy import policy_recipe, rl_batch

LAYOUTS = {
    "fsdp2": {},
    "ep2": {"ep": 2},
    "pp2_1f1b": {"pp": 2},
    "pp2_zbv": {"pp": 2, "pp_schedule": "zbv"},
    "tp2": {"tp": 2},  # vocab-parallel head: log-probs and top-k never form full logits
}
LAYOUTS_4 = {
    "pp2_fsdp2_ep2": {"pp": 2, "ep": 2},  # 2 stages, each FSDP2 over 2 data-parallel ranks, EP 2
    "tp2_pp2": {"tp": 2, "pp": 2},
    "tp2_fsdp2": {"tp": 2},  # FSDP2 over 2 data-parallel ranks of 2 tp ranks each
}
CP_LAYOUTS = {"cp2": {"cp": 2}}
CP_LAYOUTS_4 = {
    "cp2_fsdp2": {"cp": 2},  # FSDP2 over dp 2 x cp 2
    "pp2_cp2": {"pp": 2, "cp": 2},
    "tp2_cp2": {"tp": 2, "cp": 2},
}


def run_sequence(distributed: dict) -> dict:
    from hybridtrain.rl import ClippedPGLoss, DPOLoss, NLLLoss, Policy

    p = Policy(policy_recipe(distributed=distributed, training={"micro_batch_size": 1}))
    batch = rl_batch(0)
    out = {"lp": p.logprobs(batch)}
    p.packing = True
    out["lp_packed"] = p.logprobs(batch)
    p.packing = False
    out["topk"] = p.topk_logits(batch, 3)
    steps = []
    steps.append(p.train(batch, NLLLoss()))
    p.packing = True
    steps.append(p.train(batch, ClippedPGLoss(reference_policy_kl_penalty=0.1)))
    p.packing = False
    steps.append(p.train(batch, DPOLoss(sft_loss_weight=0.5), micro_batch_size=2))
    out["steps"] = steps
    out["lp_after"] = p.logprobs(batch)
    out["hf"] = {k: v.clone() for k, v in p.state_dict_hf()}
    return out


def _group(rank, world, layouts):
    return {name: run_sequence(layout) for name, layout in layouts.items()}


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return run_sequence({})


@pytest.fixture(scope="module")
def results(reference):
    return reference, run_distributed(_group, 2, LAYOUTS)


@pytest.fixture(scope="module")
def results4(reference):
    return reference, run_distributed(_group, 4, LAYOUTS_4)


# one fixture per process group, so that each stays within the per-test time limit
@pytest.fixture(scope="module")
def cp2_results(reference):
    return reference, run_distributed(_group, 2, CP_LAYOUTS)


@pytest.fixture(scope="module")
def cp4_results(reference):
    return reference, run_distributed(_group, 4, CP_LAYOUTS_4)


def _close(a, b, rel):
    return abs(a - b) <= rel * max(abs(b), 1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [  # each process group on a worker of its own (tests/conftest.py)
    *LAYOUTS, *(pytest.param(name, marks=pytest.mark.xdist_group("rl_parity_4_ranks")) for name in LAYOUTS_4)])
def test_policy_layout_matches_single_process(request, layout):
    _check(request.getfixturevalue("results4" if layout in LAYOUTS_4 else "results"), layout)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [
    *(pytest.param(name, marks=pytest.mark.xdist_group("rl_parity_cp2")) for name in CP_LAYOUTS),
    *(pytest.param(name, marks=pytest.mark.xdist_group("rl_parity_cp4")) for name in CP_LAYOUTS_4)])
def test_policy_context_parallel_matches_single_process(request, layout):
    _check(request.getfixturevalue("cp2_results" if layout in CP_LAYOUTS else "cp4_results"),
           layout)


def _check(results, layout):
    ref, per_rank = results
    for rank, res in enumerate(per_rank):
        got = res[layout]
        for key in ("lp", "lp_packed", "lp_after"):
            diff = float((got[key] - ref[key]).abs().max())
            assert diff <= 1e-5, (layout, rank, key, diff)
        if rank == 0:  # the figures (pytest -s)
            rel = max(abs(s[k] - r[k]) / max(abs(r[k]), 1e-12) for s, r in zip(got["steps"], ref["steps"])
                      for k in ("loss", "grad_norm"))
            print(f"\n{layout}: log-probs max |diff| {float((got['lp'] - ref['lp']).abs().max()):.2e} "
                  f"(after 3 steps {float((got['lp_after'] - ref['lp_after']).abs().max()):.2e}); "
                  f"train loss / grad norm max rel diff {rel:.2e}")
        assert float((got["topk"][0] - ref["topk"][0]).abs().max()) <= 1e-5
        assert torch.equal(got["topk"][1], ref["topk"][1])
        for i, (s, r) in enumerate(zip(got["steps"], ref["steps"])):
            for k in r:
                if isinstance(r[k], float) and k != "lr":
                    assert _close(s[k], r[k], 1e-5), (layout, rank, i, k, s[k], r[k])
        assert set(got["hf"]) == set(ref["hf"])
        w = max(float((got["hf"][k] - ref["hf"][k]).abs().max()) for k in ref["hf"])
        assert w <= 1e-5, (layout, rank, w)
