"""Expert parallelism: a 2-rank EP MoE layer equals the single-process layer (forward, grads)."""

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _moe_and_inputs(starve_rank1: bool = False):
    from hybridtrain.models.nemotron_h import tiny_config
    from hybridtrain.models.nemotron_h.moe import MoE

    torch.manual_seed(0)
    moe = MoE(tiny_config("mixed"), layer_idx=3)
    moe.reset_parameters()
    if starve_rank1:  # experts 4..7 (rank 1's under ep=2) are never selected
        moe.gate.e_score_correction_bias[4:] = -100.0
    # an uneven split: some experts get no tokens from one rank
    xs = [torch.randn(2, 5, 64), torch.randn(1, 3, 64)]
    ws = [torch.randn(2, 5, 64), torch.randn(1, 3, 64)]
    return moe, xs, ws


def _reference(starve_rank1: bool = False):
    moe, xs, ws = _moe_and_inputs(starve_rank1)
    outs = []
    loss = 0
    for x, w in zip(xs, ws):
        y = moe(x)
        outs.append(y.detach())
        loss = loss + (y * w).sum()
    loss.backward()
    return outs, {n: p.grad.clone() for n, p in moe.named_parameters()}


def _ep_worker(rank, world):
    import torch.distributed as dist

    from hybridtrain.distributed.expert_parallel import apply_expert_parallel
    from hybridtrain.distributed.parallel_dims import ParallelDims

    dims = ParallelDims(world_size=world, ep=2).build_mesh("cpu")
    out = []
    for starve in (False, True):
        moe, xs, ws = _moe_and_inputs(starve)
        moe.token_dispatcher = apply_expert_parallel(moe.experts, dims.mesh("ep"))
        y = moe(xs[rank])
        (y * ws[rank]).sum().backward()
        grads = {}
        for n, p in moe.named_parameters():
            g = p.grad
            assert g is not None, n  # also when no token reached this rank's experts
            if hasattr(g, "full_tensor"):  # expert weights: each rank holds its experts' grads
                g = g.full_tensor()
            else:  # replicated weights: sum the data-parallel contributions
                dist.all_reduce(g)
            grads[n] = g
        out.append((y.detach(), grads))
    return out


@pytest.mark.distributed
def test_ep2_moe_matches_single_process():
    """Uneven token counts per expert; then with every token routed to rank 0's experts."""
    res = run_distributed(_ep_worker, 2)
    for case, starve in enumerate((False, True)):
        ref_out, ref_grads = _reference(starve)
        if starve:
            assert not ref_grads["experts.up_proj"][4:].any()
        for r in range(2):
            out, grads = res[r][case]
            torch.testing.assert_close(out, ref_out[r], rtol=1e-5, atol=1e-6)
            for n, g in ref_grads.items():
                torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_ep_errors():
    from hybridtrain.distributed.expert_parallel import check_ep_backend

    assert check_ep_backend("alltoall", "cpu") == "alltoall"
    with pytest.raises(ValueError, match="deepep needs CUDA"):
        check_ep_backend("deepep", "cpu")
    with pytest.raises(ValueError, match="unknown value 'nccl'"):
        check_ep_backend("nccl", "cpu")
