import pytest
import torch
import torch.distributed as dist

from hybridtrain.distributed.parallel_dims import ParallelDims

from tests.helpers.distributed import run_distributed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=8, pp=3),
         "world size 8 is not divisible by tp·cp·pp = 3 (tp=1, cp=1, pp=3)"),
        (dict(world_size=8, tp=2, cp=2, pp=4),
         "this layout (cp=2, tp=2, pp=4) needs 16 ranks but the run has 8; "
         "add --nproc-per-node 16"),
        (dict(world_size=1, pp=2), "this layout (pp=2) needs 2 ranks but the run has 1; "
                                   "add --nproc-per-node 2"),
        (dict(world_size=1, ep=2), "needs 2 ranks"),
        (dict(world_size=8, dp_replicate=3),
         "world size 8 is not divisible by dp_replicate·tp·cp·pp = 3 "
         "(dp_replicate=3, tp=1, cp=1, pp=1)"),
        (dict(world_size=8, dp_shard=2, pp=2),
         "dp_replicate·dp_shard·cp·tp·pp = 4 (dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=2) "
         "does not equal the world size 8"),
        (dict(world_size=8, pp=2, ep=3),
         "ep=3 must divide dp_shard·cp = 4 (dp_shard=4, cp=1)"),
        (dict(world_size=4, tp=0), "distributed.tp must be >= 1 (got 0)"),
        (dict(world_size=4, dp_shard=-2), "distributed.dp_shard must be >= 1"),
        (dict(world_size=4, pp=2.0), "distributed.pp must be an integer (got 2.0)"),
    ],
)
def test_invalid_layouts(kwargs, message):
    with pytest.raises(ValueError) as e:
        ParallelDims(**kwargs)
    assert message in str(e.value)


def test_degrees_resolved():
    d = ParallelDims(world_size=16, dp_replicate=2, pp=2, ep=2)
    assert (d.dp_shard, d.dp, d.dp_cp, d.efsdp) == (4, 8, 8, 2)
    d = ParallelDims(world_size=1)
    assert d.dp_shard == 1 and not d.fsdp_enabled and not d.pp_enabled


def test_experts_divisible():
    d = ParallelDims(world_size=4, ep=4)
    d.check_experts(8)
    with pytest.raises(ValueError, match=r"n_routed_experts=6 is not divisible by ep=4"):
        d.check_experts(6)


def _mesh_worker(rank, world):
    d = ParallelDims(world_size=world, pp=2, ep=2).build_mesh("cpu")
    out = {}
    for names in [("pp",), ("dp_shard",), ("dp_shard_cp",), ("dp",), ("dp_cp",), ("ep",),
                  ("efsdp",), ("dp_shard_mod_ep",), ("dp_replicate", "dp_shard_cp")]:
        m = d.mesh(*names)
        out[names] = m.mesh.tolist()
    # collectives run on the named groups
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=d.group("ep"))
    out["ep_sum"] = t.item()
    out["coords"] = {n: d.local_rank(n) for n in ("pp", "dp_shard", "ep", "efsdp")}
    return out


@pytest.mark.distributed
def test_mesh_4_ranks():
    res = run_distributed(_mesh_worker, 4)
    r0, r3 = res[0], res[3]
    assert r0[("pp",)] == [0, 2] and r3[("pp",)] == [1, 3]
    assert r0[("dp_shard",)] == [0, 1] and r3[("dp_shard_cp",)] == [2, 3]
    assert r0[("ep",)] == [0, 1] and r0[("efsdp",)] == [0] and r0[("dp_shard_mod_ep",)] == [0]
    assert r0[("dp_replicate", "dp_shard_cp")] == [[0, 1]]
    assert [r["ep_sum"] for r in res] == [1.0, 1.0, 5.0, 5.0]
    assert res[3]["coords"] == {"pp": 1, "dp_shard": 1, "ep": 1, "efsdp": 0}


def test_ranks_from_launcher_environment():
    from hybridtrain.distributed.init import dist_env_ranks

    assert dist_env_ranks({}) == (0, 1, 0)
    assert dist_env_ranks({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (3, 4, 1)
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert dist_env_ranks(slurm) == (5, 8, 1)
    # torchrun inside an srun task wins over Slurm's task numbering
    assert dist_env_ranks({**slurm, "RANK": "2", "WORLD_SIZE": "16", "LOCAL_RANK": "2"}) == (2, 16, 2)
    assert dist_env_ranks({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == (0, 1, 0)
