"""``hybridtrain plan`` for the second model family (the dense Transformer of
tests/families/hybridtrain_dense, a package outside hybridtrain) against real runs of the recipe's
builder and trainer: each rank's parameter, gradient and AdamW-state bytes at an optimizer step
equal the plan's, in one process, under FSDP2 over 2 ranks (the plan asks the spec for the
units its parallelize function shards: ``MemoryPlanSupport.fsdp_units``) and under 2 pipeline
stages (split where the run splits), full SFT and LoRA. The family gives no activation
estimate, so the plan's activations are 0 (what it says for any such spec)."""

import pytest

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed
from tests.helpers.families import DENSE, DENSE_PREFIXES, require_dense
from tests.helpers.memory import held_at_optimizer_step, planned_bytes

LORA = {"dim": 4, "alpha": 8, "match_all_linear": True}
SECTIONS = {"full": {"allowed_target_prefixes": DENSE_PREFIXES},
            "lora": {"peft": LORA, "allowed_target_prefixes": DENSE_PREFIXES}}


def _held(layout, world):
    return {name: held_at_optimizer_step(*pu.build(layout, world, model=DENSE, **sections))
            for name, sections in SECTIONS.items()}


def _worker(rank, world, layout):
    return _held(layout, world)


def _check(layout, world, res):
    from hybridtrain.training.memory_plan import plan_memory

    for name, sections in SECTIONS.items():
        plan = plan_memory(pu.recipe(layout, False, model=DENSE, **sections), world,
                           device_type="cpu")
        for rank in range(world):
            got, want = res[rank][name], planned_bytes(plan, rank)
            print(layout, name, rank, got, want)
            assert got == {k: int(v) for k, v in want.items()}, (layout, name, rank)
            assert plan.ranks[rank].activations == 0


def test_dense_family_plan_matches_one_process():
    require_dense()
    _check({}, 1, [_held({}, 1)])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"pp": 2}], ids=["fsdp2", "pp2"])
def test_dense_family_plan_matches_real_allocation_per_rank(layout):
    require_dense()
    _check(layout, 2, run_distributed(_worker, 2, layout))
