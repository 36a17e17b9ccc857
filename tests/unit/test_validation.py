"""Plan refuses exactly what a run refuses: every layout and recipe refusal of
``training.validate.validate_run`` walked through ``hybridtrain plan``'s entry
(``plan_memory``) and finetune's (the builder with ``train_loop=True``, which stops before any
process group or allocation), with the same message; and a layout both accept."""

import re

import pytest

from tests.helpers import vlm
from tests.helpers.families import DENSE, DENSE_PREFIXES, require_dense
from tests.helpers.recipes import tiny_recipe

# (id, world size, recipe sections, the refusal's words)
REFUSALS = [
    ("ranks", 1, {"distributed": {"tp": 2}}, "needs 2 ranks but the run has 1"),
    ("experts_over_ep", 3, {"distributed": {"ep": 3}},
     "n_routed_experts=8 is not divisible by ep=3"),
    ("heads_over_tp", 3, {"distributed": {"tp": 3}}, "num_attention_heads"),
    ("ep_backend", 2, {"distributed": {"ep": 2, "ep_backend": "deepep"}},
     "deepep needs CUDA GPUs"),
    ("schedule", 2, {"distributed": {"pp": 2, "pp_schedule": "interleaved1f1b",
                                     "pp_stages_per_rank": 1}},
     "interleaves several stages per rank"),
    ("too_many_stages", 8, {"distributed": {"pp": 8}}, "8 stages need at least 8 layers"),
    ("split_points", 2, {"distributed": {"pp": 2, "pp_split_points": [3, 5]}},
     "2 split points give 3 stages"),
    ("batch_over_dp", 4, {"training": {"global_batch_size": 4}},
     "global_batch_size=4 is not divisible"),
    ("pp_microbatch", 2, {"distributed": {"pp": 2, "pp_microbatch_size": 3}},
     "not divisible by distributed.pp_microbatch_size=3"),
    ("pp_too_few_microbatches", 2, {"distributed": {"pp": 2},
                                    "training": {"global_batch_size": 2, "micro_batch_size": 2}},
     "1 micro-batches per step"),
    ("padding_free_pp", 2, {"distributed": {"pp": 2}, "packing": {"enabled": True, "padding_free": True}},
     "packing.padding_free: true with distributed.pp=2"),
    ("layer_type", 1, {"training": {"activation_checkpointing": ["conv"]}},
     "unknown layer type 'conv'"),
    ("encoder_ranks", 2, {"distributed": {"encoder_ranks": 1}}, "HeteroSupport part"),
    ("float8_cp", 2, {"distributed": {"cp": 2}, "training": {"float8": "tensorwise"}},
     "training.float8 is not available with context"),
    ("float8_evaluation", 1, {"training": {"float8": "rowwise"}, "evaluation": {"num_examples": 2}},
     "training.float8 with an evaluation section"),
]
# the vision-language model with its encoder on its own ranks: the language model's side
VLM_REFUSALS = [
    ("hetero_cp", 4, {"distributed": {"encoder_ranks": 2, "cp": 2}},
     "takes dp_shard / dp_replicate / tp / pp / ep only"),
    ("hetero_heads_over_tp", 4, {"distributed": {"encoder_ranks": 1, "tp": 3}},
     "num_attention_heads"),
    ("hetero_experts_over_ep", 4, {"distributed": {"encoder_ranks": 1, "ep": 3}},
     "n_routed_experts=8 is not divisible by ep=3"),
    ("hetero_tp_ep_ranks", 5, {"distributed": {"encoder_ranks": 2, "tp": 2, "ep": 2}},
     "leaves 3 ranks for the language model"),
    ("hetero_no_language_ranks", 2, {"distributed": {"encoder_ranks": 2}},
     "must leave ranks for the language model"),
    ("hetero_pp_too_few_microbatches", 4,
     {"distributed": {"encoder_ranks": 2, "pp": 2},
      "training": {"global_batch_size": 2, "micro_batch_size": 2}}, "1 micro-batches per step"),
    ("hetero_batch_over_lanes", 4, {"distributed": {"encoder_ranks": 1},
                                    "training": {"global_batch_size": 4, "micro_batch_size": 2}},
     "global_batch_size=4 is not divisible"),
]
DENSE_REFUSALS = [
    ("dense_tp", 2, {"distributed": {"tp": 2}}, "dense_test supports data and pipeline"),
    ("dense_evaluation_pp", 2, {"distributed": {"pp": 2}, "evaluation": {"num_examples": 2}},
     "does not decode through pipeline stages"),
]


def _refusals(recipe, world):
    """(plan's refusal, the run's refusal) of ``recipe`` on ``world`` ranks."""
    from hybridtrain.training.memory_plan import plan_memory
    from hybridtrain.training.builder import build

    out = []
    for call in (lambda: plan_memory(recipe, world, device_type="cpu"),
                 lambda: build(recipe, "cpu", world_size=world, data=False, train_loop=True)):
        with pytest.raises(ValueError) as e:
            call()
        out.append(str(e.value))
    return out


@pytest.mark.parametrize("world, sections, words", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_plan_and_run_refuse_the_same(world, sections, words):
    plan, run = _refusals(tiny_recipe(**sections), world)
    assert plan == run
    assert re.search(re.escape(words), plan), plan


@pytest.mark.parametrize("world, sections, words", [r[1:] for r in DENSE_REFUSALS],
                         ids=[r[0] for r in DENSE_REFUSALS])
def test_plan_and_run_refuse_the_same_for_an_outside_family(world, sections, words):
    require_dense()
    recipe = tiny_recipe(model=DENSE, allowed_target_prefixes=DENSE_PREFIXES, **sections)
    plan, run = _refusals(recipe, world)
    assert plan == run
    assert re.search(re.escape(words), plan), plan


@pytest.mark.parametrize("world, sections, words", [r[1:] for r in VLM_REFUSALS],
                         ids=[r[0] for r in VLM_REFUSALS])
def test_plan_and_run_refuse_the_same_with_an_encoder_on_its_own_ranks(tmp_path, world,
                                                                      sections, words):
    recipe = vlm.vlm_recipe(str(tmp_path), **sections)
    plan, run = _refusals(recipe, world)
    assert plan == run
    assert re.search(re.escape(words), plan), plan


def test_a_valid_layout_passes_both():
    """The checks refuse nothing the run takes: pp 2 x ep 2 with LoRA plans, and validates."""
    from hybridtrain.models.spec import model_spec_for
    from hybridtrain.training.memory_plan import meta_model, plan_memory
    from hybridtrain.config.sections import recipe_config
    from hybridtrain.training.validate import validate_run

    recipe = tiny_recipe(distributed={"pp": 2, "ep": 2},
                         peft={"dim": 4, "alpha": 8, "match_all_linear": True})
    assert plan_memory(recipe, 4, device_type="cpu").degrees["ep"] == 2
    cfg = recipe_config(recipe)
    spec, model = meta_model(cfg.model)
    assert model_spec_for(model) is spec
    dims = validate_run(cfg, 4, spec, model, "cpu")
    assert (dims.pp, dims.ep, dims.dp_shard) == (2, 2, 2)
