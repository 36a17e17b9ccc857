"""Layout helpers and user errors that need no processes: schedules, stage splits, options."""

import pytest
import torch

from hybridtrain.distributed.parallel_dims import ParallelDims
from hybridtrain.data.micro_batches import merge_micro_batches, position_ids_from_cu_seqlens
from hybridtrain.distributed.pipeline_layout import (
    balanced_split,
    resolve_schedule,
    split_from_points,
    stage_ids_for_rank,
    stage_rank,
)


def test_schedule_names():
    assert resolve_schedule("1F1B").name == "1f1b"
    assert resolve_schedule("Interleaved1F1B").multi
    assert resolve_schedule("interleaved_1f1b").name == "interleaved1f1b"
    assert resolve_schedule("ZBVZeroBubble").style == "v"
    with pytest.raises(ValueError) as e:
        resolve_schedule("pipedream")
    msg = str(e.value)
    assert "unknown pipeline schedule 'pipedream'" in msg
    assert "1f1b, gpipe, interleaved1f1b" in msg and "zbv" in msg


def test_stage_placement():
    assert stage_ids_for_rank(0, 2, 1, "loop") == [0]
    assert stage_ids_for_rank(1, 2, 2, "loop") == [1, 3]
    assert stage_ids_for_rank(0, 2, 2, "v") == [0, 3]
    assert [stage_rank(s, 2, "v") for s in range(4)] == [0, 1, 1, 0]
    assert [stage_rank(s, 2, "loop") for s in range(4)] == [0, 1, 0, 1]


def test_balanced_split_by_cost():
    # one expensive layer in the middle; the head is expensive too
    costs = [1, 1, 8, 1, 1, 1]
    assert balanced_split(costs, 2) == [(0, 3), (3, 6)]
    assert balanced_split(costs, 2, last_extra=6) == [(0, 3), (3, 6)]
    assert balanced_split([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # the head pushes layers towards the first stage
    assert balanced_split([1] * 8, 2, last_extra=4) == [(0, 6), (6, 8)]
    with pytest.raises(ValueError, match="4 stages need at least 4 layers, the model has 3"):
        balanced_split([1, 1, 1], 4)


def test_manual_split_points():
    assert split_from_points([2, "layers.5"], 7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert split_from_points(["backbone.layers.3"], 7, 2) == [(0, 3), (3, 7)]
    with pytest.raises(ValueError, match="1 split points give 2 stages, but the layout has 4"):
        split_from_points([3], 7, 4)
    with pytest.raises(ValueError, match="strictly increasing"):
        split_from_points([4, 2], 7, 3)
    with pytest.raises(ValueError, match="cannot read 'x.y'"):
        split_from_points(["x.y"], 7, 2)


def test_nemotron_layer_costs_and_layouts():
    from hybridtrain.distributed.layout import config_section
    from hybridtrain.distributed.pipeline_layout import pipeline_layout
    from hybridtrain.models.nemotron_h import tiny_config
    from hybridtrain.models.spec import get_model_spec

    spec = get_model_spec("nemotron_h")
    cfg = tiny_config("mixed")  # M * - E M * E
    costs = spec.flops.layer(cfg, 4096)
    assert costs[1] > costs[2]  # attention at 4k tokens costs more than the MLP
    head = spec.flops.head(cfg)

    def layout(dims, **distributed):
        return pipeline_layout(7, dims, config_section("distributed", distributed), costs, head)

    dims = ParallelDims(world_size=2, pp=2)
    sched, n, ranges, ids = layout(dims, pp_schedule="interleaved1f1b")
    assert n == 4 and ids == [0, 2] and ranges[0][0] == 0 and ranges[-1][1] == 7
    with pytest.raises(ValueError, match="runs one stage per rank"):
        layout(dims, pp_schedule="1f1b", pp_stages_per_rank=2)
    with pytest.raises(ValueError, match="pp_stages_per_rank >= 2"):
        layout(dims, pp_schedule="interleaved1f1b", pp_stages_per_rank=1)
    with pytest.raises(ValueError, match="8 stages need at least 8 layers, the model has 7"):
        layout(ParallelDims(world_size=4, pp=4), pp_schedule="interleaved1f1b")


def test_unsupported_degrees_and_ep_errors():
    from hybridtrain.distributed.expert_parallel import check_ep_backend
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    model = NemotronHForCausalLM(tiny_config("mixed"))
    from hybridtrain.distributed.layout import parallel_dims_from_config
    from hybridtrain.models.nemotron_h.parallelize import check_tp

    check_tp(model.config, 2)  # 4 heads, 2 kv heads, 2 Mamba groups
    check_tp(tiny_config("mixed", n_groups=4), 4)  # 4 > 2 kv heads: one each (replicated k/v)
    with pytest.raises(ValueError, match=r"distributed.tp=3 does not divide num_attention_heads = 4"):
        check_tp(model.config, 3)
    with pytest.raises(ValueError, match=r"tp=4 does not divide n_groups \(Mamba2 B/C groups\) = 2"):
        check_tp(tiny_config("dense", hybrid_override_pattern="M-M"), 4)
    assert parallel_dims_from_config({"tp": 2, "sequence_parallel": True}, 2, build_mesh=False).tp == 2
    with pytest.raises(ValueError, match="n_routed_experts=8 is not divisible by ep=3"):
        ParallelDims(world_size=3, ep=3).check_experts(8)
    with pytest.raises(ValueError, match="deepep needs CUDA"):
        check_ep_backend("deepep", "cpu")


def test_packed_positions_travel_by_rows():
    # 2 rows of 6 tokens: docs [3, 3 | 2, 4]
    cu = torch.tensor([0, 3, 6, 8, 12])
    pos = position_ids_from_cu_seqlens(cu, 2, 6)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]]
    mbs = [{"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long),
            "cu_seqlens": torch.tensor([0, 2, 4])},
           {"input_ids": torch.ones(1, 6, dtype=torch.long), "labels": torch.ones(1, 6, dtype=torch.long),
            "position_ids": torch.arange(6)[None]}]
    b = merge_micro_batches(mbs)
    assert b["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert b["labels"][0].tolist() == [1, 1, 1, 1, -100, -100]


def test_single_process_plan_is_the_model():
    """With one process the plan runs the model's own modules: same loss as its forward."""
    from hybridtrain.distributed.layout import config_section
    from hybridtrain.distributed.parallel_plan import parallelize
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
    from hybridtrain.models.spec import model_spec_for, set_train_loss
    from hybridtrain.ops.loss import LinearCrossEntropy

    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_config("mixed"))
    ids = torch.randint(0, 256, (2, 12))
    labels = torch.randint(0, 256, (2, 12))
    ref = model(ids, labels=labels) * labels.numel()
    set_train_loss(model, LinearCrossEntropy(reduction="sum"))
    plan = parallelize(model_spec_for(model), model, ParallelDims(world_size=1),
                       config_section("distributed"), config_section("training"), device="cpu",
                       autocast_dtype=None)
    assert plan.model is model and plan.stages == [model] and plan.pipeline is None
    assert plan.dims.dp == 1 and plan.dims.dp_rank == 0
    torch.testing.assert_close(plan.stages[0](ids, labels=labels), ref, rtol=1e-6, atol=1e-5)
    assert set(dict(model.named_parameters())) == set(
        dict(NemotronHForCausalLM(tiny_config("mixed")).named_parameters()))


def test_pipeline_stages_are_the_model_without_its_unowned_parts():
    """The spec's stages hold the model's own modules (same parameter objects and names) and
    run the model's forward: hidden states through the stages equal the model's loss."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
    from hybridtrain.models.spec import model_spec_for

    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_config("mixed"))
    spec = model_spec_for(model)
    layers = spec.pipeline.layers(model)
    assert layers == [str(i) for i in range(7)]
    first = spec.pipeline.stage(model, layers[:3], True, False)
    last = spec.pipeline.stage(model, layers[3:], False, True)
    assert type(first) is type(model) and type(last) is type(model)
    assert first.lm_head is None and first.backbone.norm_f is None
    assert last.backbone.embeddings is None and last.loss is model.loss
    params = dict(model.named_parameters())
    parts = {**dict(first.named_parameters()), **dict(last.named_parameters())}
    assert set(parts) == set(params)
    assert all(parts[n] is p for n, p in params.items())
    ids = torch.randint(0, 256, (2, 12))
    labels = torch.randint(0, 256, (2, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]] * 2)  # two documents per row
    with torch.no_grad():
        hidden = first(ids, position_ids=pos)
        assert hidden.shape == (2, 12, model.config.hidden_size)
        got = last(hidden, position_ids=pos, labels=labels)
        assert torch.equal(got, model(ids, position_ids=pos, labels=labels))


def test_config_helpers(monkeypatch):
    import hybridtrain.distributed.init as init
    from hybridtrain.config import build_config
    from hybridtrain.distributed.layout import config_section, parallel_dims_from_config

    dims = parallel_dims_from_config({"pp": 2, "ep": 2, "dp_shard": -1}, 8, build_mesh=False)
    assert (dims.dp_shard, dims.efsdp) == (4, 2)
    started = {}
    monkeypatch.setattr(init, "init_distributed", lambda **kw: started.update(kw) or
                        init.DistInfo(0, 1, 0, torch.device("cpu")))
    cfg = build_config({"distributed": {"backend": "auto", "timeout_seconds": 120},
                        "training": {"device": "cpu"}})
    with init.process_group(cfg) as info:
        assert info.world_size == 1
    assert started == {"device": "cpu", "backend": None, "timeout_minutes": 2.0}
    d = config_section("distributed", {"pp_schedule": "zbv"})
    assert d.pp_schedule == "zbv" and d.ep_backend == "alltoall"  # the recipe's defaults
    assert config_section("training", {"activation_checkpointing": "moe"}
                          ).activation_checkpointing == "moe"
    with pytest.raises(ValueError, match="pp_shedule"):  # an unknown option is an error
        config_section("distributed", {"pp_shedule": "zbv"})
    with pytest.raises(ValueError, match="world size 8 is not divisible by tp·cp·pp = 3"):
        parallel_dims_from_config({"pp": 3}, 8, build_mesh=False)


def test_activation_checkpointing_policies():
    from hybridtrain.distributed.activation_checkpoint import ACPolicy, parse_ac_policy
    from hybridtrain.models.nemotron_h.parallelize import BLOCK_TYPES

    assert parse_ac_policy(True) == ACPolicy("all")
    assert parse_ac_policy(False).mode == "none"
    assert parse_ac_policy(2) == ACPolicy("every", every=2)
    assert parse_ac_policy({"every": 3}).every == 3
    assert parse_ac_policy("mamba, moe", BLOCK_TYPES).layer_types == ("linear_attention", "moe")
    assert parse_ac_policy(["*", "E"], BLOCK_TYPES).layer_types == ("full_attention", "moe")
    with pytest.raises(ValueError, match="unknown layer type 'conv'"):
        parse_ac_policy(["conv"], BLOCK_TYPES)
    with pytest.raises(ValueError, match="cannot read"):
        parse_ac_policy({"bogus": 1})


def test_activation_checkpointing_is_bitwise_and_keeps_state_dict_keys():
    from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
    from hybridtrain.models.nemotron_h.parallelize import BLOCK_TYPES

    def run(policy):
        torch.manual_seed(0)
        m = NemotronHForCausalLM(tiny_config("mixed"))
        keys = list(m.state_dict())
        chosen = apply_activation_checkpointing(m.backbone.layers, policy,
                                                BLOCK_TYPES) if policy else []
        assert list(m.backbone.layers) == [str(i) for i in range(7)]  # same keys, wrapped blocks
        assert list(m.state_dict()) == keys
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
        m(ids, labels=ids).backward()
        return chosen, {n: p.grad for n, p in m.state_dict(keep_vars=True).items()
                        if isinstance(p, torch.nn.Parameter)}

    _, ref = run(None)
    for policy, expect in [(True, list(range(7))), ({"every": 3}, [0, 3, 6]), ("moe", [3, 6])]:
        chosen, grads = run(policy)
        assert chosen == expect
        assert grads.keys() == ref.keys()
        for n, g in ref.items():
            assert torch.equal(grads[n], g), n


def test_activation_checkpointing_names_the_torch_version_without_the_wrapper(monkeypatch):
    import importlib
    import re

    from hybridtrain.distributed import activation_checkpoint as ac
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    real = importlib.import_module

    def without_wrapper(name, *a, **k):
        if name == ac._WRAPPER_MODULE:
            raise ModuleNotFoundError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", without_wrapper)
    m = NemotronHForCausalLM(tiny_config("mixed"))
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} does not provide")):
        ac.apply_activation_checkpointing(m.backbone.layers, True)
    assert ac.apply_activation_checkpointing(m.backbone.layers, False) == []


def test_micro_batches_in_flight_come_from_the_schedule_the_run_builds():
    """Read from the order of the schedule ``build_schedule`` makes (as for the run): 1F1B's
    warm-up (pp - rank), interleaved 1F1B's (in units of the rank's two stages), the V
    schedule's equal share on every rank; a count the schedule refuses is the run's error."""
    from hybridtrain.distributed.pipeline_layout import micro_batches_in_flight

    assert [micro_batches_in_flight("1f1b", 4, r, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [micro_batches_in_flight("gpipe", 2, r, 1, 8) for r in range(2)] == [8, 8]
    assert [micro_batches_in_flight("interleaved1f1b", 2, r, 2, 4) for r in range(2)] == [2.5, 1.5]
    assert [micro_batches_in_flight("zbv", 4, r, 2, 8) for r in range(4)] == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="2 micro-batches per step"):
        micro_batches_in_flight("1f1b", 4, 0, 1, 2)
