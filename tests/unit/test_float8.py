"""``training.float8``: which Linear layers torchao's float8 training takes on a Nano-shaped
tiny model, training that stays close to the high-precision run, and weights (state dicts,
checkpoints) that stay high-precision, so a run moves between float8 and bf16 freely."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
from hybridtrain.models.spec import model_spec_for
from hybridtrain.training.float8 import block_names, convert_to_float8, plan_float8

pytest.importorskip("torchao.float8")

# Nemotron 3 Nano's layer mix (Mamba2, MoE, attention), at dims that are multiples of 16
NANO_PATTERN = "MEMEM*EMEM*EME"


def _nano(seed: int = 0) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    return NemotronHForCausalLM(tiny_config("moe", hybrid_override_pattern=NANO_PATTERN,
                                            mamba_num_heads=16, mamba_head_dim=8))


def _blocks(model):
    return block_names(model, model_spec_for(model).pipeline.layers(model))


def test_coverage_on_the_nano_shaped_model():
    model = _nano()
    blocks = _blocks(model)
    plan = plan_float8(model, blocks)
    inner = [n for n in plan.converted + list(plan.kept)
             if not n.startswith((blocks[0] + ".", blocks[-1] + ".")) and n != "lm_head"]
    assert sorted(plan.converted) == sorted(inner)  # every Linear of the inner blocks
    kinds = {n.rsplit(".", 1)[-1] for n in plan.converted}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj",
            "up_proj", "down_proj"} <= kinds
    assert plan.kept["lm_head"] == "outside the blocks"
    assert all(plan.kept[n] == "in the first or last block" for n in plan.kept if n != "lm_head")
    assert len(plan.converted) == 28 and len(plan.kept) == 5
    # the filter replaces the default: the end blocks convert, attention stays high-precision
    custom = plan_float8(model, blocks, keep=[r"\.(q|k|v|o)_proj$"])
    assert any(n.startswith(blocks[0] + ".") for n in custom.converted)
    assert not any(n.endswith("q_proj") for n in custom.converted)
    with pytest.raises(ValueError, match="training.float8_filter"):
        plan_float8(model, blocks, keep="q_proj")


def _train(model, steps: int = 4, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 32), generator=gen)
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(ids, labels=ids) / ids.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_close_to_bf16_and_keeps_high_precision_weights(recipe):
    ref = _train(_nano())
    model = _nano()
    plan = convert_to_float8(model, recipe, _blocks(model), emulate=True)
    assert type(model.get_submodule(plan.converted[0])).__name__ == "Float8Linear"
    losses = _train(model)
    assert all(abs(a - b) / b < 0.05 for a, b in zip(losses, ref)), (losses, ref)
    assert losses[-1] < losses[0]
    # the state dict is a bf16 run's: same names, high-precision tensors, loads both ways
    state = model.state_dict()
    plain = _nano(seed=1)
    assert set(state) == set(plain.state_dict())
    assert all(t.dtype == torch.float32 for t in state.values() if t.is_floating_point())
    plain.load_state_dict(state)  # float8 -> bf16
    again = _nano(seed=2)
    convert_to_float8(again, recipe, _blocks(again), emulate=True)
    again.load_state_dict(plain.state_dict())  # bf16 -> float8
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), state.values()))


def test_a_missing_recipe_is_refused():
    model = _nano()
    with pytest.raises(ValueError, match="training.float8"):
        convert_to_float8(model, "mxfp8", _blocks(model))


def test_float8_with_activation_checkpointing_is_exact():
    """The recipe's builder converts; checkpointed blocks recompute the same float8 forward."""
    from tests.helpers import parity

    float8 = {"float8": "tensorwise", "float8_filter": []}
    runs = [parity.train(*parity.build({}, 1, ac=ac, training=float8)) for ac in (False, True)]
    assert runs[0] == runs[1]
