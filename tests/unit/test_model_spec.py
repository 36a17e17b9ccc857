"""The model contract: specs, one forward (pipeline stages run the model's own forward), the
single-process path through ``parallelize``, and what generic code may not do."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from hybridtrain.distributed.layout import config_section
from hybridtrain.distributed.parallel_dims import ParallelDims
from hybridtrain.distributed.parallel_plan import parallelize
from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
from hybridtrain.models.spec import get_model_spec, model_spec_for

def _model(seed: int = 0) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    return NemotronHForCausalLM(tiny_config("mixed"))


def test_spec_lookup():
    spec = get_model_spec("nemotron_h")
    assert model_spec_for(_model()) is spec
    assert model_spec_for(NemotronHForCausalLM) is spec
    with pytest.raises(ValueError, match="not a registered model"):
        model_spec_for(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no model spec named 'gpt'"):
        get_model_spec("gpt")


def test_pipeline_stages_run_the_models_forward():
    model = _model()
    spec = model_spec_for(model)
    names = spec.pipeline.layers(model)
    cut = len(names) // 2
    first = spec.pipeline.stage(model, names[:cut], True, False)
    last = spec.pipeline.stage(model, names[cut:], False, True)
    assert type(first) is type(model) and type(last) is type(model)
    assert not spec.pipeline.is_complete(first) and not spec.pipeline.is_complete(last)
    assert spec.pipeline.is_complete(model)
    own = {id(p): n for n, p in model.named_parameters()}
    for stage in (first, last):  # the model's own parameter objects, under the same names
        for n, p in stage.named_parameters():
            assert own[id(p)] == n
    n_stage = sum(p.numel() for s in (first, last) for p in s.parameters())
    assert n_stage == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    labels = torch.randint(0, model.config.vocab_size, (2, 12))
    labels[:, :3] = -100
    with torch.no_grad():
        hidden = first(ids)
        assert hidden.shape == (2, 12, model.config.hidden_size)
        assert torch.equal(last(hidden, labels=labels), model(ids, labels=labels))
        assert torch.equal(last(hidden), model(ids))


def test_one_process_goes_through_parallelize():
    model = _model()
    plan = parallelize(model_spec_for(model), model, ParallelDims(world_size=1),
                       config_section("distributed"), config_section("training"),
                       device=torch.device("cpu"), autocast_dtype=None)
    assert plan.model is model and plan.stages == [model] and plan.pipeline is None
    assert plan.dims.dp == 1 and plan.dims.dp_rank == 0 and plan.dims.dp_group is None


def test_unknown_layout_option_is_an_error():
    with pytest.raises(ValueError, match="pp_shedule"):
        config_section("distributed", {"pp_shedule": "1f1b"})


def test_activation_checkpointing_through_parallelize_changes_no_result():
    """One process, every second block checkpointed by ``parallelize``: those blocks wrapped,
    and the loss and every gradient bit-identical to the plain model's."""
    from hybridtrain.models.spec import set_train_loss
    from hybridtrain.ops.loss import LinearCrossEntropy

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    results = []
    for ac in (False, {"every": 2}):
        model = _model()
        set_train_loss(model, LinearCrossEntropy(reduction="sum"))
        parallelize(model_spec_for(model), model, ParallelDims(world_size=1),
                    config_section("distributed"),
                    config_section("training", {"activation_checkpointing": ac}),
                    device=torch.device("cpu"), autocast_dtype=None)
        wrapped = [k for k, b in model.backbone.layers.items()
                   if hasattr(b, "_checkpoint_wrapped_module")]
        loss = model(ids, labels=ids)
        loss.backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad
                 for n, p in model.named_parameters()}
        results.append((wrapped, loss.detach(), grads))
    (plain, loss, grads), (wrapped, loss_ac, grads_ac) = results
    assert plain == [] and wrapped == [str(i) for i in range(0, len(model.backbone.layers), 2)]
    assert torch.equal(loss_ac, loss)
    assert grads_ac.keys() == grads.keys()
    for n, g in grads.items():
        assert torch.equal(grads_ac[n], g), n


def _dense_spec(**changes):
    """The outside family's spec (tests/families/hybridtrain_dense) with ``changes``."""
    import dataclasses

    from tests.helpers.families import dense_spec

    return dataclasses.replace(dense_spec(), name="dense_variant", **changes)


def test_registration_names_a_missing_or_ill_typed_piece():
    from hybridtrain.models.spec import FlopsCount, HFAdapter, MemoryPlanSupport, register_model_spec

    with pytest.raises(ValueError, match="'dense_variant': flops must be a FlopsCount"):
        register_model_spec(_dense_spec(flops=None))
    with pytest.raises(ValueError, match="'dense_variant': pipeline must be a PipelineSplit"):
        register_model_spec(_dense_spec(pipeline=lambda m: []))
    with pytest.raises(ValueError, match="'dense_variant': part dict is not one of"):
        register_model_spec(_dense_spec(parts=({"tp_plan": None},)))
    with pytest.raises(ValueError, match="two MemoryPlanSupport parts"):
        register_model_spec(_dense_spec(parts=(MemoryPlanSupport(), MemoryPlanSupport())))
    with pytest.raises(ValueError, match="model_cls must be an nn.Module class"):
        register_model_spec(_dense_spec(model_cls=dict))
    with pytest.raises(ValueError, match="HFAdapter.save must be callable"):
        HFAdapter(save="model.safetensors")
    with pytest.raises(ValueError, match="FlopsCount.head must be callable"):
        FlopsCount(layer=len, head=1.0, batch=len)


def test_a_missing_optional_part_is_named_with_the_spec():
    from hybridtrain.models.spec import HeteroSupport, MetaInit

    spec = _dense_spec()
    assert isinstance(spec.part(MetaInit, "meta init"), MetaInit)
    assert spec.find(HeteroSupport) is None
    with pytest.raises(ValueError, match="encoder_ranks needs the model spec 'dense_variant' to "
                                         "have a HeteroSupport part; it has MetaInit, PeftSupport, "
                                         "MemoryPlanSupport, Decoding"):
        spec.part(HeteroSupport, "distributed.encoder_ranks")


def test_layer_types_name_activation_checkpointing_policies():
    """Per-type ``training.activation_checkpointing`` names are the model spec's LayerTypes;
    a model without that part takes only all / every k-th."""
    from hybridtrain.distributed.activation_checkpoint import parse_ac_policy
    from hybridtrain.models.spec import LayerTypes
    from tests.helpers.families import dense_spec, require_dense

    DenseConfig, DenseLM, DENSE = require_dense().DenseConfig, require_dense().DenseLM, dense_spec()

    types = get_model_spec("nemotron_h").part(LayerTypes, "per-type checkpointing")
    assert parse_ac_policy("mamba, moe", types).layer_types == ("linear_attention", "moe")
    assert parse_ac_policy(["*", "E", "MLP"], types).layer_types == ("full_attention", "moe", "mlp")
    with pytest.raises(ValueError, match=re.escape(
            "training.activation_checkpointing: unknown layer type 'conv'; this model's types "
            "are linear_attention, full_attention, mlp, moe (or mamba, attention, M, *, -, E)")):
        parse_ac_policy({"layer_types": ["moe", "conv"]}, types)
    with pytest.raises(ValueError, match="LayerTypes.aliases must map str to one of names"):
        LayerTypes(names=("mlp",), of=type, aliases={"ffn": "dense"})

    def wrapped(ac):
        model = DenseLM(DenseConfig())
        parallelize(DENSE, model, ParallelDims(world_size=1), config_section("distributed"),
                    config_section("training", {"activation_checkpointing": ac}),
                    device=torch.device("cpu"), autocast_dtype=None)
        return [k for k, b in model.model.layers.items()
                if hasattr(b, "_checkpoint_wrapped_module")]

    n = DenseConfig().num_hidden_layers
    assert wrapped(True) == [str(i) for i in range(n)]
    assert wrapped({"every": 2}) == [str(i) for i in range(0, n, 2)]
    with pytest.raises(ValueError, match=re.escape(
            "training.activation_checkpointing: activation checkpointing by layer type (mlp): "
            "this model does not name its layers' types; use true or {every: k}")):
        wrapped(["mlp"])


@pytest.mark.parametrize("sections", [
    {"training": {"activation_checkpointing": True}},
    {"peft": {"dim": 4, "alpha": 8, "match_all_linear": True}},
], ids=["activation_checkpointing", "lora"])
def test_no_runtime_patching(sections):
    """After the recipe's builder and one training step (checkpointing, LoRA): no module has
    its ``forward`` replaced by an instance attribute, and every entry of a module's parameter
    and buffer tables is a ``Parameter`` / tensor registered the ordinary way."""
    from tests.helpers import parity

    b, trainer = parity.build({}, 1, **sections)
    parity.train(b, trainer, steps=1)
    for name, module in b.model.named_modules():
        assert "forward" not in vars(module), f"{name}.forward replaced at run time"
        assert all(p is None or isinstance(p, nn.Parameter)
                   for p in module._parameters.values()), name
        assert all(t is None or isinstance(t, torch.Tensor)
                   for t in module._buffers.values()), name


def test_registration_checks_the_model_contract():
    """A spec whose model, config or HF writer lacks a piece of the contract (models/spec.py:
    CausalLM, ModelConfig, HFSave, Decoder) is refused naming that piece."""
    import dataclasses

    from hybridtrain.models.spec import Decoding, HFAdapter, register_model_spec
    from tests.helpers.families import dense_spec

    spec = dense_spec()
    model, config = spec.model_cls, spec.config_cls

    class NoSource(config):
        @classmethod
        def from_dict(cls, d):
            return cls()

    class OtherType(config):
        model_type = "llama"

    class OldSave(model):
        def save_pretrained(self, save_dir):
            pass

    class NoGenerate(model):
        generate = None

    def save_without_tensors(state_dict, config, out_dir, dtype=None):
        pass

    no_context = type("NoContext", (), {"model_type": "dense_test", "hidden_size": 8,
                                        "vocab_size": 8, "to_dict": config.to_dict,
                                        "from_dict": config.__dict__["from_dict"]})

    bare = type("Bare", (nn.Module,), {"forward": model.forward,
                                       "save_pretrained": model.save_pretrained,
                                       "from_pretrained": model.from_pretrained})
    cases = [
        (dict(config_cls=NoSource), "NoSource.from_dict must take .* it lacks source"),
        (dict(config_cls=OtherType), "OtherType must have the class attribute model_type = "
                                     "'dense_test'"),
        (dict(config_cls=no_context), "NoContext has no field or property context_length"),
        (dict(model_cls=bare, parts=()), "Bare must declare the class attribute name_or_path"),
        (dict(model_cls=OldSave), "OldSave.save_pretrained must take .* it lacks dtype, "
                                  "state_dict"),
        (dict(hf=HFAdapter(save=save_without_tensors)), "HFAdapter.save must take .* it lacks "
                                                         "max_shard_size, tensors"),
        (dict(model_cls=NoGenerate, parts=(Decoding(),)), "NoGenerate has no generate"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            register_model_spec(dataclasses.replace(spec, **changes))


def test_a_built_model_keeps_its_head_last_and_its_layers_by_index():
    from tests.helpers.families import dense_spec, require_dense

    spec, dense = dense_spec(), require_dense()
    model = dense.DenseLM(dense.DenseConfig())
    spec.check_model(model)
    model.extra = nn.Linear(2, 2)  # registered after the head
    with pytest.raises(ValueError, match="lm_head's parameters must come last.*'extra.bias'"):
        spec.check_model(model)
    model = dense.DenseLM(dense.DenseConfig())
    model.model.layers = nn.ModuleDict({f"block{k}": b for k, b in model.model.layers.items()})
    with pytest.raises(ValueError, match="keyed by their global index.*'block0'"):
        spec.check_model(model)


def test_families_come_from_entry_points():
    """The built-in families and the outside one are found through the entry-point group; the
    plan says so when a family gives no activation estimate."""
    from importlib.metadata import entry_points

    from hybridtrain.models.spec import ENTRY_POINT_GROUP
    from hybridtrain.recipes.plan import format_plan
    from hybridtrain.training.memory_plan import plan_memory
    from tests.helpers.families import DENSE, DENSE_PREFIXES, require_dense
    from tests.helpers.recipes import tiny_recipe

    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert {"nemotron_h", "nemotron_h_vlm"} <= names, names
    require_dense()
    assert model_spec_for(require_dense().DenseLM) is get_model_spec("dense_test")
    plan = plan_memory(tiny_recipe(model=DENSE, allowed_target_prefixes=DENSE_PREFIXES), 1,
                       device_type="cpu")
    assert "warning: the model spec 'dense_test' gives no activation estimate" in format_plan(plan)
    assert not plan_memory(tiny_recipe(), 1, device_type="cpu").warnings


def test_the_loss_slot_takes_only_a_declared_train_loss():
    """The model's loss slot is a declared part of the contract (TrainLoss): what does not
    keep it is refused naming it, by set_train_loss and by the built-model check."""
    from hybridtrain.models.spec import TrainLoss, set_train_loss
    from hybridtrain.ops.loss import LinearCrossEntropy
    from hybridtrain.rl.head import PolicyHead
    from tests.helpers.families import dense_spec

    spec = dense_spec()
    model = spec.model_cls(spec.config_cls())
    assert isinstance(model.loss, TrainLoss) and isinstance(PolicyHead(), TrainLoss)
    with pytest.raises(ValueError, match="set_train_loss takes a TrainLoss module"):
        set_train_loss(model, nn.CrossEntropyLoss())
    head = PolicyHead()
    set_train_loss(model, head)
    assert model.loss is head
    spec.check_model(model)
    set_train_loss(model, LinearCrossEntropy(reduction="sum"))
    del model.loss.recompute
    with pytest.raises(ValueError, match="no loss module with a recompute flag"):
        spec.check_model(model)


def test_continuations_scored_from_one_prefill_match_the_forward():
    """``Decoding.score_continuations``: answers of left-padded prompts of different lengths,
    each from a copy of its prompt's state, give the logits of the whole sequence's forward."""
    from hybridtrain.models.spec import Decoding

    model = _model().eval()
    score = model_spec_for(model).find(Decoding).score_continuations
    prompts = [[5, 9, 2, 7, 1, 3], [4, 8, 6]]
    answers = [(0, [11, 12, 13]), (1, [15, 16]), (0, [14])]  # longest first
    ids = torch.tensor([prompts[0], [0] * 3 + prompts[1]])
    mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    conts = torch.tensor([a + a[-1:] * (3 - len(a)) for _, a in answers])
    logits = score(model, ids, mask, torch.tensor([p for p, _ in answers]), conts,
                   [len(a) for _, a in answers])
    assert logits.shape == (3, 3, model.config.vocab_size)
    for r, (p, a) in enumerate(answers):
        with torch.no_grad():
            full = model(torch.tensor([prompts[p] + a[:-1]]))[0].float()
        torch.testing.assert_close(logits[r, :len(a)], full[len(prompts[p]) - 1:], atol=1e-4,
                                   rtol=1e-4)
    with pytest.raises(ValueError, match="Decoding.score_continuations must be callable"):
        Decoding(score_continuations="shared prefix")
