"""``hybridtrain plan`` for the tiny vision-language model against real runs on 2 gloo ranks
(FSDP2 over 2 ranks; 2 pipeline stages): each rank's parameter, gradient and AdamW-state bytes
at an optimizer step of the recipe's builder and trainer equal the plan's figures for that
rank; the plan asks the model's spec for its FSDP2 units (the ViT blocks, the projector and the
language model's units) and builds the model as the run does."""

import pytest

from tests.helpers import vlm
from tests.helpers.distributed import run_distributed
from tests.helpers.memory import held_at_optimizer_step, planned_bytes



def _worker(rank, world, tmp, layout):
    return held_at_optimizer_step(*vlm.build(tmp, layout, world))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"pp": 2}], ids=["fsdp2", "pp2"])
def test_vlm_plan_matches_real_allocation_per_rank(tmp_path, layout):
    from hybridtrain.recipes.plan import plan_memory

    res = run_distributed(_worker, 2, str(tmp_path), layout)
    plan = plan_memory(vlm.vlm_recipe(str(tmp_path), layout), 2, device_type="cpu")
    for rank, got in enumerate(res):
        want = planned_bytes(plan, rank)
        print(layout, rank, got, want)
        assert got == {k: int(v) for k, v in want.items()}, (layout, rank)
