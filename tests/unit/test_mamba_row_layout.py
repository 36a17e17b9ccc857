"""The Mamba2 in_proj / conv1d rows held group by group: the mapping to and from the Hub's
``[z | x | B | C | dt]`` order, and checkpoints of the older order refused."""

import json
import os

import pytest
import torch

from hybridtrain.models.nemotron_h import tiny_config
from hybridtrain.models.nemotron_h.hf_io import hub_layout
from hybridtrain.models.nemotron_h.mamba2 import group_major_rows


def test_group_major_rows():
    cfg = tiny_config("mixed")  # 8 heads of 16, 2 groups, state 16: in_proj 328 rows, conv 320
    rows, conv = group_major_rows(cfg), group_major_rows(cfg, conv=True)
    assert sorted(rows.tolist()) == list(range(328)) and sorted(conv.tolist()) == list(range(192))
    # group 0: z_0 (Hub rows 0..63), x_0 (128..191), B_0 (256..271), C_0 (288..303), dt_0 (320..323)
    assert rows[:64].tolist() == list(range(64)) and rows[64:128].tolist() == list(range(128, 192))
    assert rows[128:144].tolist() == list(range(256, 272)) and rows[160:164].tolist() == list(range(320, 324))
    assert conv[:64].tolist() == list(range(64)) and conv[64:80].tolist() == list(range(128, 144))
    one = tiny_config("mixed", n_groups=1)
    assert torch.equal(group_major_rows(one), torch.arange(2 * 128 + 2 * 16 + 8))


def test_hub_layout_round_trip():
    cfg = tiny_config("mixed")
    for name, shape in {"backbone.layers.0.mixer.in_proj.weight": (328, 64),
                        "backbone.layers.0.mixer.in_proj.bias": (328,),
                        "backbone.layers.0.mixer.in_proj.lora_B": (328, 4),
                        "backbone.layers.0.mixer.conv1d.weight": (192, 1, 4),
                        "backbone.layers.0.mixer.conv1d.bias": (192,)}.items():
        t = torch.randn(shape)
        hub = hub_layout(name, t, cfg, to_hub=True)
        assert not torch.equal(hub, t)
        assert torch.equal(hub_layout(name, hub, cfg, to_hub=False), t)
    t = torch.randn(328, 4)
    for name in ("backbone.layers.0.mixer.in_proj.lora_A", "backbone.layers.0.mixer.out_proj.weight"):
        assert hub_layout(name, t, cfg, to_hub=True) is t
    assert hub_layout("backbone.layers.0.mixer.in_proj.weight", t, tiny_config("mixed", n_groups=1),
                      to_hub=True) is t


def test_checkpoint_of_the_older_row_order_is_refused(tmp_path):
    from tests.helpers.models import tiny_model

    from hybridtrain.training.checkpoint import Checkpointer
    from hybridtrain.training.checkpoint_reader import convert
    from hybridtrain.training.optim import build_optimizer

    model = tiny_model(0)  # n_groups=2: rows held group-major
    ck = Checkpointer(str(tmp_path / "run"))
    step = ck.save(1, model, build_optimizer(model))
    state_path = os.path.join(step, "trainer_state.json")
    state = json.load(open(state_path))
    assert state["state_format"] == "mamba_rows_group_major"
    ck.load(step, model, build_optimizer(model))  # the same layout loads
    del state["state_format"]  # as written before the marker existed
    json.dump(state, open(state_path, "w"))
    with pytest.raises(ValueError, match="refusing to load .* laid out as 'before layout markers"):
        ck.load(step, model, build_optimizer(model))
    with pytest.raises(ValueError, match="refusing to load"):
        convert(step, str(tmp_path / "hf"))
