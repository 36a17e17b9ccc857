"""The typed recipe (config/recipe.py, one tree of dataclasses): sections made in code with their
defaults, checked when the recipe loads (types, ranges, rules over several keys), still able to
name the line a value came from; and every numeric key declares the range it accepts."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from hybridtrain.config import ConfigError, ConfigNode, load_config
from hybridtrain.config.recipe import SECTIONS, TOP_LEVEL_KEYS
from hybridtrain.config.recipe_fields import KeyProblem, Range
from hybridtrain.config.reference import main as reference_main
from hybridtrain.config.reference import page
from hybridtrain.config.sections import (
    CheckpointSection, PeftSection, RecipeConfig, TrainingSection, config_section, recipe_config,
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


def test_a_type_checker_sees_each_setting_with_its_type():
    """The classes are source code: their annotations resolve to the accepted types."""
    hints = typing.get_type_hints(TrainingSection)
    assert hints["max_steps"] == int | None and hints["global_batch_size"] is int
    assert typing.get_type_hints(RecipeConfig)["peft"] == PeftSection | None
    with pytest.raises(TypeError, match="max_stepz"):
        TrainingSection(max_stepz=3)  # a typo fails where the object is made


def test_a_section_made_in_code_holds_its_defaults_and_is_checked():
    t = TrainingSection(max_steps=3)
    assert (t.max_steps, t.global_batch_size, t.seed) == (3, 8, 42)
    assert config_section("training", {"max_steps": 3}) == t
    a, b = CheckpointSection(), CheckpointSection()
    assert a.save_on_signal == b.save_on_signal and a.save_on_signal is not b.save_on_signal
    assert RecipeConfig().training == TrainingSection() and RecipeConfig().peft is None
    with pytest.raises(KeyProblem, match=r"'training.max_steps' must be >= 1, got 0 in "
                                         r"'training' section built in code"):
        TrainingSection(max_steps=0)
    with pytest.raises(ConfigError, match="nothing says which layers to adapt"):
        PeftSection()  # peft's defaults adapt nothing: a rule over its keys
    assert PeftSection(match_all_linear=True).dim == 8


def test_a_recipe_made_in_code_loads_as_its_values():
    model = {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM"}
    r = recipe_config(RecipeConfig(model=model, training=TrainingSection(max_steps=3)))
    assert r.training.max_steps == 3 and r.node.training.max_steps == 3
    assert "max_steps: 3" in r.to_yaml() and isinstance(r.model, ConfigNode)
    with pytest.raises(ConfigError, match="not allowed"):
        recipe_config(RecipeConfig(model={"_target_": "os.system"}))


def test_an_environment_variable_sets_its_keys_default_in_code_and_in_a_recipe(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("HYBRIDTRAIN_MAMBA_KERNELS", "0")
    assert TrainingSection().mamba_kernels is False
    assert load_config(_recipe(tmp_path)).training.mamba_kernels is False
    assert TrainingSection(mamba_kernels="auto").mamba_kernels == "auto"  # a given value wins


def test_a_loaded_recipe_is_typed_once(tmp_path):
    r = recipe_config(_recipe(tmp_path))
    assert isinstance(r.training, TrainingSection)
    assert (r.training.max_steps, r.training.grad_clip, r.distributed.tp) == (7, 0.5, 2)
    assert r.training.seed == TrainingSection().seed
    assert isinstance(r.optimizer, ConfigNode)  # a _target_ mapping stays the node
    assert r.peft is None and r.evaluation is None  # absent optional sections
    assert isinstance(r.dist_env, ConfigNode) and isinstance(r.model, ConfigNode)  # open ones
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
    ("  grad_clip: big", "'training.grad_clip' must be float or null, got 'big'"),
    ("  grad_clip: -1", "'training.grad_clip' must be >= 0, got -1"),
    ("  max_stpes: 3", "unknown key 'training.max_stpes' in .*recipe.yaml:4; did you mean "
                       "'max_steps'"),
])
def test_a_wrong_value_is_refused_when_the_recipe_loads(tmp_path, line, message):
    text = RECIPE.replace("  grad_clip: 0.5", line)
    with pytest.raises(ConfigError, match=message) as e:
        recipe_config(_recipe(tmp_path, text))
    assert "recipe.yaml:4" in str(e.value)
    with pytest.raises(ConfigError, match="'distributed.tp' must be int"):
        config_section("distributed", {"tp": "2"})


def test_the_run_folders_config_yaml_loads_back_as_the_same_recipe(tmp_path):
    first = load_config(_recipe(tmp_path), ["--lr_scheduler.lr_decay_style=cosine"])
    saved = tmp_path / "config.yaml"
    saved.write_text(first.to_yaml())
    again = load_config(saved)
    assert again == first and recipe_config(again) == recipe_config(first)


NUMERIC_KEYS = [(sec.name, spec) for sec in SECTIONS.values() for spec in sec.keys.values()
                if spec.numeric]


@pytest.mark.parametrize("section, spec", NUMERIC_KEYS,
                         ids=[f"{s}.{k.name}" for s, k in NUMERIC_KEYS])
def test_every_numeric_key_declares_its_range_and_a_value_outside_it_is_refused(
        tmp_path, section, spec):
    """Generated from the dataclasses: a new numeric key without a range fails here."""
    name = f"{section}.{spec.name}"
    assert spec.range is not None, f"{name} takes a number: give it key(..., range='[a, b)')"
    assert spec.default is None or not isinstance(spec.default, (int, float)) \
        or isinstance(spec.default, bool) or spec.default in spec.range, name
    recipe = _recipe(tmp_path, "training:\n  max_steps: 2\n")
    for number in spec.range.outside():
        # a list of numbers (optimizer.betas, benchmark.seq_lengths): its range is each item's
        value, named = ([number], f"{name}[0]") if spec.numeric_items else (number, name)
        with pytest.raises(ConfigError) as e:
            load_config(recipe, [f"--{name}={value}"])
        text = str(e.value)
        assert f"'{named}' must be " in text and f"{spec.range.describe()}, got {number}" in text
        assert f"command-line override '--{name}={value}'" in text, text
        with pytest.raises(KeyProblem, match=re.escape(f"'{named}' must be")):
            SECTIONS[section].cls(**{spec.name: value})


@pytest.mark.parametrize("yaml_text, line, message", [
    ("training:\n  num_epochs: 0\n", 2, "'training.num_epochs' must be > 0, got 0"),
    ("training:\n  max_steps: -5\n", 2, "'training.max_steps' must be >= 1, got -5"),
    ("training:\n  global_batch_size: 0\n", 2, "'training.global_batch_size' must be >= 1"),
    ("optimizer:\n  lr: -1.0e-4\n", 2, "'optimizer.lr' must be >= 0, got -0.0001"),
    ("optimizer:\n  lr: .nan\n", 2, "'optimizer.lr' must be >= 0, got nan"),
    ("lr_scheduler:\n  lr_decay_style: cosine\n  lr_decay_steps: 10\n  lr_warmup_steps: 20\n",
     4, "lr_warmup_steps=20 is longer than lr_decay_steps=10"),
    ("lr_scheduler:\n  lr_decay_samples: 64\n  lr_warmup_steps: 2\n", 3,
     "lr_warmup_steps mixed with lr_decay_samples"),
    ("lr_scheduler:\n  lr_decay_style: wsd\n  lr_decay_steps: 10\n  lr_warmup_steps: 5\n"
     "  lr_wsd_decay_steps: 6\n", 5, "lr_wsd_decay_steps=6 does not fit after a warmup of 5"),
    ("optimizer:\n  betas: [0.9, 1.5]\n", 2, "'optimizer.betas[1]' must be a number in [0, 1)"),
    ("optimizer:\n  betas: [0.9]\n", 2, "optimizer.betas must be two numbers in [0, 1)"),
    ("benchmark:\n  seq_lengths: [64, 2.5]\n", 2,
     "'benchmark.seq_lengths[1]' must be an integer >= 1, got 2.5"),
    ("grpo:\n  num_prompts_per_step: 6\n  updates_per_rollout: 4\n", 3,
     "grpo.num_prompts_per_step=6 must be a multiple of grpo.updates_per_rollout=4"),
    ("grpo:\n  num_generations_per_prompt: 1\n", 2, "a group of one has every advantage 0"),
])
def test_values_that_cannot_mean_anything_are_refused_naming_the_line(tmp_path, yaml_text,
                                                                      line, message):
    with pytest.raises(ConfigError) as e:
        load_config(_recipe(tmp_path, yaml_text))
    assert message in str(e.value) and f"recipe.yaml:{line}" in str(e.value), str(e.value)


def test_a_warmup_longer_than_a_run_without_a_decay_length_still_loads(tmp_path):
    """A shortened trial of a long recipe warms up over the whole run (a warning, not an error)."""
    cfg = load_config(_recipe(tmp_path, "lr_scheduler:\n  lr_decay_style: cosine\n"
                                        "  lr_warmup_steps: 100\n"), ["--training.max_steps=5"])
    assert cfg.lr_scheduler.lr_warmup_steps == 100


def test_a_range_reads_as_an_interval():
    r = Range.parse("(0, 1]")
    assert (0 in r, 0.5 in r, 1 in r, 1.5 in r, float("inf") in Range.parse("[0, inf)")) == \
        (False, True, True, False, False)
    assert (str(r), r.describe(), Range.parse("[1, inf)").describe()) == ("(0, 1]", "in (0, 1]",
                                                                          ">= 1")


def test_the_reference_page_lists_every_key_with_its_default_range_and_unit():
    text = page()
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines()
            if line.startswith("| `")}
    for sec in SECTIONS.values():
        assert f"## `{sec.name}`" in text
        for spec in sec.keys.values():
            assert spec.name in rows and (spec.range is None or f"`{spec.range}`" in text)
    training_rows = [line for line in text.splitlines() if line.startswith("| `max_steps` |")]
    assert training_rows == ["| `max_steps` | `null` | `[1, inf)` or `null` | steps | optimizer "
                             "steps to run; null -> derived from num_epochs |"]
    assert all(f"| `{k}` |" in text for k in TOP_LEVEL_KEYS)


def test_the_reference_prints_the_sections_asked_for(capsys):
    assert reference_main(["training", "peft"]) == 0
    out = capsys.readouterr().out
    assert "## `training`" in out and "## `peft`" in out and "## `optimizer`" not in out
    assert reference_main(["trainig"]) == 2
    assert "no section trainig" in capsys.readouterr().err
