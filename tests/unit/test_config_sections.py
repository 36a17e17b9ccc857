"""The typed recipe (config/sections.py): made from schema.py alone, checked when it loads, and
still able to name the line a value came from."""

from __future__ import annotations

import dataclasses

import pytest

from hybridtrain.config import ConfigError, ConfigNode, load_config
from hybridtrain.config.schema import SECTIONS, section_defaults
from hybridtrain.config.sections import (
    SECTION_TYPES, RecipeConfig, TrainingSection, config_section, recipe_config,
)

RECIPE = """\
model: {_target_: hybridtrain.models.nemotron_h.NemotronHForCausalLM}
training:
  max_steps: 7
  grad_clip: 0.5
distributed:
  tp: 2
optimizer:
  _target_: torch.optim.SGD
  lr: 0.1
"""


def _recipe(tmp_path, text=RECIPE):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_sections_carry_exactly_the_schemas_keys_and_defaults():
    for name, cls in SECTION_TYPES.items():
        assert [f.name for f in dataclasses.fields(cls)] == list(SECTIONS[name].keys)
        given = {"match_all_linear": True} if name == "peft" else {}  # peft's defaults adapt nothing
        # the loaded section holds the schema's defaults, and the class adds none of its own
        assert config_section(name, given).to_dict() == {**section_defaults(name), **given}
        assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(cls))
    fixed = [n for n, s in SECTIONS.items() if s.kind == "fixed"]
    assert sorted(SECTION_TYPES) == sorted(fixed)
    fields = [f.name for f in dataclasses.fields(RecipeConfig)]
    assert fields == ["node", *SECTIONS]


def test_a_loaded_recipe_is_typed_once(tmp_path):
    r = recipe_config(_recipe(tmp_path))
    assert isinstance(r.training, TrainingSection)
    assert (r.training.max_steps, r.training.grad_clip, r.distributed.tp) == (7, 0.5, 2)
    assert r.training.seed == SECTIONS["training"].keys["seed"].default
    assert isinstance(r.optimizer, ConfigNode)  # a _target_ mapping stays the node
    assert r.peft is None and r.evaluation is None  # absent optional sections
    assert recipe_config(r) is r and config_section("training", r.training) is r.training
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.training.max_steps = 8


def test_an_error_names_the_recipe_line(tmp_path):
    r = recipe_config(_recipe(tmp_path))
    assert r.training.where("grad_clip") == f"{r.source_file}:4"
    assert r.distributed.where("tp") == f"{r.source_file}:6"
    assert r.training.replace(grad_clip=1.0).where("grad_clip") == f"{r.source_file}:4"
    override = recipe_config(load_config(_recipe(tmp_path), ["--training.seed=3"]))
    assert "--training.seed=3" in override.training.where("seed")


@pytest.mark.parametrize("line, message", [
    ("  grad_clip: big", "'training.grad_clip' must be float or int or null, got 'big'"),
    ("  max_stepz: 3", "unknown key 'training.max_stepz'"),
])
def test_a_wrong_value_is_refused_when_the_recipe_loads(tmp_path, line, message):
    text = RECIPE.replace("  grad_clip: 0.5", line)
    with pytest.raises(ConfigError, match=message) as e:
        recipe_config(_recipe(tmp_path, text))
    assert "recipe.yaml:4" in str(e.value)
    with pytest.raises(ConfigError, match="'distributed.tp' must be int"):
        config_section("distributed", {"tp": "2"})
