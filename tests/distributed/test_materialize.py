"""Meta-device build, layout, then each rank materialises only its shards: random init gives
the same weights under every layout (the same seed), and loading a sharded bf16 Hub checkpoint
(per-expert tensors, an index) gives exactly the tensors one-process ``from_pretrained`` gives,
into fp32 masters or a bf16 frozen base under LoRA (FSDP2, expert slices, pipeline stages)."""

import os

import pytest
import torch

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed

LAYOUTS = ({"dp_shard": 2}, {"ep": 2}, {"pp": 2})
MOE = {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed"}
LORA = {"dim": 4, "alpha": 8, "match_all_linear": True}


def _build(layout, world, model, peft=None, seed=0):
    import torch.distributed as dist

    from hybridtrain.training.builder import build

    recipe = pu.recipe(layout, packed=False, training={"seed": seed})
    recipe["model"] = model
    if peft:
        recipe["peft"] = peft
    rank = dist.get_rank() if dist.is_initialized() else 0
    b = build(recipe, "cpu", is_main=rank == 0, world_size=world, data=False)
    local = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
             for n, t in b.model.state_dict().items()}
    parts = [local]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, local)
    state = {n: t for p in parts for n, t in p.items()}
    return state, {n: t.dtype for n, t in state.items()}


def _random_model():
    return {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM", "config": MOE}


def _pretrained(path, dtype):
    return {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM.from_pretrained",
            "local_dir": path, "dtype": dtype}


def _worker(rank, world, models):
    return [[_build(layout, world, model, peft) for layout in LAYOUTS]
            for model, peft in models]


def _assert_same(got, ref, what):
    state, dtypes = got
    ref_state, ref_dtypes = ref
    assert set(state) == set(ref_state), what
    for n, t in ref_state.items():
        assert dtypes[n] == ref_dtypes[n], (what, n)
        assert torch.equal(state[n], t), (what, n)


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    """A bf16 Hub checkpoint of the tiny mixed model in several files (with an index)."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    torch.manual_seed(3)
    model = NemotronHForCausalLM(tiny_config("mixed"))
    out = tmp_path_factory.mktemp("hub") / "bf16"
    model.save_pretrained(out, max_shard_size="40KB", dtype=torch.bfloat16)
    return str(out)


@pytest.mark.distributed
def test_random_init_and_loading_equal_under_layouts(hub_dir):
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM

    assert os.path.isfile(os.path.join(hub_dir, "model.safetensors.index.json"))
    models = [(_random_model(), None), (_pretrained(hub_dir, "float32"), None),
              (_pretrained(hub_dir, "bfloat16"), LORA)]
    refs = [_build({}, 1, m, p) for m, p in models]
    # loading is exactly one-process from_pretrained (bf16 on disk -> fp32 masters, bf16 base)
    for (state, dtypes), dtype in ((refs[1], torch.float32), (refs[2], torch.bfloat16)):
        hf = NemotronHForCausalLM.from_pretrained(hub_dir, dtype=dtype).state_dict()
        for n, t in hf.items():
            assert dtypes[n] == t.dtype and torch.equal(state[n], t), n
    assert any("lora_A" in n for n in refs[2][0])
    res = run_distributed(_worker, 2, models)
    for r in range(2):
        for got_model, ref in zip(res[r], refs):
            for got, layout in zip(got_model, LAYOUTS):
                _assert_same(got, ref, (r, layout))


def test_random_init_depends_on_seed_only():
    """The meta path's init: same seed -> same weights; another seed -> other weights."""
    a, _ = _build({}, 1, _random_model())
    b, _ = _build({}, 1, _random_model())
    c, _ = _build({}, 1, _random_model(), seed=1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
