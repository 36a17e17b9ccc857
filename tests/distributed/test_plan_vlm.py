"""``hybridtrain plan`` for the tiny vision-language model against real runs on 2 gloo ranks
(FSDP2 over 2 ranks; 2 pipeline stages): each rank's parameter, gradient and AdamW-state bytes
at an optimizer step of the recipe's builder and trainer equal the plan's figures for that
rank (the plan asks the model's spec for its FSDP2 units: the ViT blocks, the projector and the
language model's units, and builds the model as the run does), and what the rank's model keeps
for backward (the ViT and projector on the first stage, the language model's layers, the
micro-batches the pipeline keeps in flight) stays under the plan's activation figure.

The data: one image of 64 patches per sample, samples of at most 57 tokens (the plan's row
length, ``dataset.seq_length``), so the plan's images per micro-batch are the run's."""

import pytest

from tests.helpers import vlm
from tests.helpers.distributed import run_distributed
from tests.helpers.memory import activations_of_run, held_at_optimizer_step, planned_bytes


def _dataset(tmp: str) -> dict:
    return {"min_patches": 64, "max_patches": 64, "seq_length": 57,
            "path": {"_target_": "hybridtrain.data.write_synthetic_shapes",
                     "out_dir": f"{tmp}/data", "n": 64, "seed": 0, "text_only": 0.0}}


def _worker(rank, world, tmp, layout):
    b, trainer = vlm.build(tmp, layout, world, dataset=_dataset(tmp))
    return activations_of_run(b, trainer), held_at_optimizer_step(b, trainer)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"pp": 2}], ids=["fsdp2", "pp2"])
def test_vlm_plan_matches_real_allocation_per_rank(tmp_path, layout):
    from hybridtrain.recipes.plan import plan_memory

    res = run_distributed(_worker, 2, str(tmp_path), layout)
    plan = plan_memory(vlm.vlm_recipe(str(tmp_path), layout, dataset=_dataset(str(tmp_path))),
                       2, device_type="cpu")
    for rank, (acts, got) in enumerate(res):
        want = planned_bytes(plan, rank)
        print(layout, rank, got, want)
        assert got == {k: int(v) for k, v in want.items()}, (layout, rank)
        r = plan.ranks[rank]
        assert ("vision" in r.activations_per_micro_batch) == (0 in r.stages)
        run = acts["saved"] + acts["loss_context"]
        print(layout, rank, "activations plan / run", r.activations, run,
              f"{r.activations / run:.3f}")
        assert 1.0 <= r.activations / run <= 1.6, (layout, rank)
