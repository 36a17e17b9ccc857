"""The typed recipe (config/sections.py; the classes in section_types.py, written from
schema.py by scripts/gen_sections.py): checked when it loads, and still able to name the line a
value came from."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from hybridtrain.config import ConfigError, ConfigNode, load_config
from hybridtrain.config.schema import SECTIONS, section_defaults
from hybridtrain.config.sections import (
    PeftSection, RecipeConfig, TrainingSection, config_section, recipe_config,
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


def test_the_section_classes_are_current():
    """config/section_types.py is what scripts/gen_sections.py writes from schema.py today."""
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "scripts" / "gen_sections.py"
    spec = importlib.util.spec_from_file_location("gen_sections", script)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.OUT.read_text() == gen.render(), "regenerate: python scripts/gen_sections.py"


def test_a_type_checker_sees_each_setting_with_its_type():
    """The classes are source code: their annotations resolve to the accepted types."""
    hints = typing.get_type_hints(TrainingSection)
    assert hints["max_steps"] == int | None and hints["global_batch_size"] is int
    assert typing.get_type_hints(RecipeConfig)["peft"] == PeftSection | None
    with pytest.raises(TypeError, match="max_stepz"):
        TrainingSection(max_stepz=3)  # a typo fails where the object is made


def test_a_section_built_in_code_holds_the_schemas_defaults():
    given = {"max_steps": 3}
    assert config_section("training", given).to_dict() == {**section_defaults("training"),
                                                           **given}
    peft = config_section("peft", {"match_all_linear": True})  # peft's defaults adapt nothing
    assert (peft.match_all_linear, peft.dim) == (True, section_defaults("peft")["dim"])


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
