"""Recipe loading: defaults, typo suggestions with file:line, overrides, ${env:...},
``_target_`` allow-list and instantiation."""

from __future__ import annotations

import copy
import functools
import pickle
import subprocess
import sys
import textwrap

import pytest

from hybridtrain.config import (
    ConfigNode,
    build_config,
    instantiate,
    load_config,
    parse_overrides,
    parse_scalar,
)
from hybridtrain.config.loader import split_cli_overrides
from hybridtrain.config.recipe import TrainingSection


def write(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


BASE = """\
model:
  _target_: torch.nn.Linear
  in_features: 4
  out_features: 2
training:
  global_batch_size: 16
  max_steps: 10
optimizer:
  lr: 1e-4
  betas: [0.9, 0.95]
"""


# -------------------------------------------------------------------------------- loading
def test_defaults_filled_and_attribute_access(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert isinstance(cfg, ConfigNode) and isinstance(cfg.training, dict)
    assert cfg.training.max_steps == 10 and cfg["training"]["global_batch_size"] == 16
    assert cfg.training.micro_batch_size == TrainingSection().micro_batch_size
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)  # YAML 1.1 gotcha
    assert cfg.optimizer.betas == [0.9, 0.95]
    assert cfg.checkpoint.dir and cfg.distributed.tp == 1 and cfg.dist_env == {}
    assert cfg.peft is None and cfg.dataset is None  # optional / open sections absent
    assert cfg.allowed_target_prefixes == []


def test_where_names_file_and_line(tmp_path):
    path = write(tmp_path, BASE)
    cfg = load_config(path)
    assert cfg.training.where("max_steps") == f"{path}:7"
    assert cfg.optimizer.where("betas") == f"{path}:10"
    assert cfg.training.dotted_path("max_steps") == "training.max_steps"
    with pytest.raises(AttributeError, match="did you mean 'max_steps'"):
        cfg.training.max_step


def test_typo_key_suggests_nearest_with_file_and_line(tmp_path):
    path = write(tmp_path, BASE + "checkpoint:\n  dir: out\n  keep_lst: 2\n")
    with pytest.raises(ValueError) as e:
        load_config(path)
    msg = str(e.value)
    assert "unknown key 'checkpoint.keep_lst'" in msg
    assert f"{path}:13" in msg and "recipe.yaml" in msg
    assert "did you mean 'keep_last'?" in msg


def test_typo_in_training_and_unknown_section(tmp_path):
    path = write(tmp_path, "training:\n  max_stpes: 3\n")
    with pytest.raises(ValueError, match=r"unknown key 'training.max_stpes' in .*recipe.yaml:2; "
                                         r"did you mean 'max_steps'\?"):
        load_config(path)
    path = write(tmp_path, "trainng:\n  max_steps: 3\n")
    with pytest.raises(ValueError, match=r"unknown section 'trainng'.*did you mean 'training'"):
        load_config(path)


def test_type_and_choice_checks(tmp_path):
    with pytest.raises(ValueError, match=r"'training.max_steps' must be int or null.*recipe.yaml:2"):
        load_config(write(tmp_path, "training:\n  max_steps: ten\n"))
    with pytest.raises(ValueError, match="'training.dtype' must be one of"):
        load_config(write(tmp_path, "training:\n  dtype: float8\n"))
    cfg = load_config(write(tmp_path, "training:\n  dtype: BF16\nlr_scheduler:\n  lr_decay_style: WSD\n"))
    assert cfg.training.dtype == "bfloat16" and cfg.lr_scheduler.lr_decay_style == "wsd"


def test_duplicate_key_and_bad_yaml(tmp_path):
    with pytest.raises(ValueError, match=r"duplicate key 'training.seed' in .*recipe.yaml:3 "
                                         r"\(first set at line 2\)"):
        load_config(write(tmp_path, "training:\n  seed: 1\n  seed: 2\n"))
    with pytest.raises(ValueError, match=r"recipe.yaml:2: invalid YAML: .*expected the node content") as e:
        load_config(write(tmp_path, "training: [\n"))
    assert "<unicode string>" not in str(e.value)
    with pytest.raises(ValueError, match=r"recipe.yaml:3: invalid YAML: .*mapping values"):
        load_config(write(tmp_path, "training:\n  seed: 1\n  lr: a: b\n"))
    with pytest.raises(ValueError, match="recipe file not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.timeout(60)
def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    """Nested aliases ("billion laughs": 10**9 values from 10 lines) are refused, naming the
    file; so is one in a command-line value; a few aliases stay fine."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    with pytest.raises(ValueError, match=r"bomb.yaml: the YAML expands to more than 100000 values"):
        load_config(write(tmp_path, "\n".join(lines) + "\n", "bomb.yaml"))
    with pytest.raises(ValueError, match="a command-line value: the YAML expands"):
        load_config(write(tmp_path, "training:\n  seed: 1\n"),
                    ["--+model.x={" + ", ".join(line.replace(": ", ": ", 1) for line in lines) + "}"])
    cycle = write(tmp_path, "model: &m\n  x: *m\n", "cycle.yaml")
    with pytest.raises(ValueError, match="cycle.yaml: the YAML"):
        load_config(cycle)
    cfg = load_config(write(tmp_path, "model:\n  _target_: x.y\n  a: &a [1, 2]\n  b: *a\n"),
                      allowed_target_prefixes=["x."])
    assert cfg.model.b == [1, 2]


def test_target_section_takes_any_keys_and_fixed_section_may_be_target(tmp_path):
    cfg = load_config(write(tmp_path, """\
        model:
          _target_: hybridtrain.whatever.Builder
          anything_goes: 1
        optimizer:
          _target_: torch.optim.SGD
          lr: 0.1
          momentum: 0.9
        """))
    assert cfg.model.anything_goes == 1
    assert cfg.optimizer == {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}


def test_pickle_and_deepcopy_keep_nodes(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert clone == cfg and isinstance(clone.training, ConfigNode)
        assert clone.training.where("max_steps").endswith("recipe.yaml:7")
    assert cfg.to_dict() == cfg and type(cfg.to_dict()["training"]) is dict
    assert "max_steps: 10" in cfg.to_yaml()


def test_loading_does_not_import_torch(tmp_path):
    path = write(tmp_path, BASE + "dist_env:\n  nccl_debug: WARN\n")
    code = ("import sys; from hybridtrain.config import load_config, apply_dist_env; "
            f"c = load_config({str(path)!r}); apply_dist_env(c.dist_env, environ={{}}); "
            "import hybridtrain.cli; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -------------------------------------------------------------------------------- overrides
@pytest.mark.parametrize("raw,value", [
    ("5", 5), ("-3", -3), ("0.5", 0.5), ("1e-4", 1e-4), ("3E5", 3e5), ("true", True),
    ("false", False), ("null", None), ("~", None), ("[1, 2]", [1, 2]), ("[a, b]", ["a", "b"]),
    ("hello", "hello"), ("'5'", "5"), ("", ""), ("#x", "#x"), ("a:b", "a:b"),
])
def test_parse_scalar(raw, value):
    assert parse_scalar(raw) == value and type(parse_scalar(raw)) is type(value)


def test_override_forms_and_types(tmp_path):
    cfg = load_config(write(tmp_path, BASE), [
        "--training.max_steps=20",           # int
        "--optimizer.lr", "3e-4",            # separate value, float
        "--training.grad_clip=null",         # null
        "--training.compile=true",           # bool
        "--optimizer.betas=[0.8, 0.9]",      # list
        "--optimizer.betas.1=0.99",          # list item by index
        "--checkpoint.dir", "runs/x y",      # string with a space
        "--model.out_features=3",            # key present in an open section
        "--+model.bias=false",               # new key in an open section
        "--training.dtype=fp32",
    ])
    assert cfg.training.max_steps == 20
    assert cfg.optimizer.lr == 3e-4
    assert cfg.training.grad_clip is None
    assert cfg.training.compile is True
    assert cfg.optimizer.betas == [0.8, 0.99]
    assert cfg.checkpoint.dir == "runs/x y"
    assert cfg.model.out_features == 3 and cfg.model.bias is False
    assert cfg.training.dtype == "float32"
    assert cfg.training.where("max_steps") == "command-line override '--training.max_steps=20'"


def test_override_recipe_key_absent_from_recipe_and_optional_section(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["--training.seed=7", "--peft.dim=4",
                                              "--peft.match_all_linear=true"])
    assert cfg.training.seed == 7
    assert cfg.peft.dim == 4 and cfg.peft.alpha == 32  # peft enabled, other keys defaults
    assert load_config(write(tmp_path, BASE + "peft:\n  dim: 8\n"), ["--peft=null"]).peft is None


def test_override_nested_new_keys(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["--+model.config.hidden_size=64",
                                              "--+benchmark.steps=3"])
    assert cfg.model.config == {"hidden_size": 64}
    assert cfg.benchmark.steps == 3


def test_override_unknown_key_errors(tmp_path):
    path = write(tmp_path, BASE)
    with pytest.raises(ValueError, match=r"unknown key 'training.max_stpes' in command-line "
                                         r"override '--training.max_stpes=3'; did you mean "
                                         r"'max_steps'"):
        load_config(path, ["--training.max_stpes=3"])
    with pytest.raises(ValueError, match=r"unknown key 'model.in_feature'.*did you mean "
                                         r"'in_features'.*--\+model.in_feature="):
        load_config(path, ["--model.in_feature=3"])
    with pytest.raises(ValueError, match="keys of 'training' are fixed"):
        load_config(path, ["--+training.foo=1"])  # '+' does not add keys to a fixed section
    with pytest.raises(ValueError, match="unknown section 'trainig'.*did you mean 'training'"):
        load_config(path, ["--trainig.seed=1"])
    with pytest.raises(ValueError, match="'training.max_steps' must be int or null"):
        load_config(path, ["--training.max_steps=lots"])
    with pytest.raises(ValueError, match="has no value"):
        parse_overrides(["--training.max_steps"])
    with pytest.raises(ValueError, match="malformed override"):
        parse_overrides(["--training..x=1"])


def test_override_mapping_form():
    cfg = build_config({"training": {"max_steps": 1}}, {"training.max_steps": 9,
                                                         "+model._target_": "torch.nn.ReLU"})
    assert cfg.training.max_steps == 9 and cfg.model == {"_target_": "torch.nn.ReLU"}


def test_split_cli_overrides():
    known = {"-c", "--config", "--nproc-per-node"}
    rest, ovs = split_cli_overrides(
        ["-c", "r.yaml", "--training.seed", "3", "--nproc-per-node", "2", "--a.b=1",
         "--+m.x", "-1", "--flag.only"], known)
    assert rest == ["-c", "r.yaml", "--nproc-per-node", "2"]
    assert ovs == ["--training.seed", "3", "--a.b=1", "--+m.x", "-1", "--flag.only"]
    parsed = parse_overrides(ovs[:5])
    assert [(o.path, o.value, o.add) for o in parsed] == [
        (("training", "seed"), 3, False), (("a", "b"), 1, False), (("m", "x"), -1, True)]


# -------------------------------------------------------------------------------- ${env:...}
def test_env_interpolation(tmp_path):
    path = write(tmp_path, """\
        training:
          max_steps: ${env:HT_STEPS,10}
          seed: ${env:HT_SEED}
        checkpoint:
          dir: /runs/${env:HT_RUN,demo}/out
        model:
          _target_: torch.nn.Linear
          bias: ${env:HT_BIAS,true}
          name: ${env:HT_NAME,}
        """)
    cfg = load_config(path, environ={"HT_SEED": "3"})
    assert cfg.training.max_steps == 10 and cfg.training.seed == 3  # parsed as YAML scalars
    assert cfg.checkpoint.dir == "/runs/demo/out"                     # embedded: substitution
    assert cfg.model.bias is True and cfg.model.name == ""
    cfg = load_config(path, environ={"HT_SEED": "4", "HT_STEPS": "7", "HT_RUN": "r1"})
    assert (cfg.training.max_steps, cfg.training.seed, cfg.checkpoint.dir) == (7, 4, "/runs/r1/out")


def test_env_missing_without_default_names_key(tmp_path):
    path = write(tmp_path, "training:\n  seed: ${env:HT_SEED_MISSING}\n")
    with pytest.raises(ValueError, match=r"HT_SEED_MISSING is not set, needed by "
                                         r"'training.seed' \(.*recipe.yaml:2\)"):
        load_config(path, environ={})
    # an override replacing the value removes the need for the variable
    assert load_config(path, ["--training.seed=1"], environ={}).training.seed == 1
    # overrides may use ${env:...} too
    assert load_config(path, ["--training.seed=${env:S,5}"], environ={}).training.seed == 5


# -------------------------------------------------------------------------------- _target_
def test_disallowed_target_names_target_key_and_fix(tmp_path):
    path = write(tmp_path, "model:\n  _target_: os.system\n  command: echo pwned\n")
    with pytest.raises(ValueError) as e:
        load_config(path)
    msg = str(e.value)
    assert "_target_ 'os.system'" in msg and "'model._target_'" in msg
    assert f"{path}:2" in msg and "allowed_target_prefixes" in msg
    # nested targets are checked too, and prefix matching is by module, not by string
    path = write(tmp_path, "dataset:\n  _target_: torch.nn.Identity\n"
                           "  inner:\n    _target_: torchvision.models.resnet18\n")
    with pytest.raises(ValueError, match=r"'torchvision.models.resnet18' at "
                                         r"'dataset.inner._target_'.*recipe.yaml:4"):
        load_config(path)
    with pytest.raises(ValueError, match="not allowed"):
        instantiate({"_target_": "os.getcwd"})  # plain dicts use the default list


def test_allowed_prefix_extension(tmp_path):
    body = "model:\n  _target_: collections.OrderedDict\n  a: 1\n"
    with pytest.raises(ValueError, match="not allowed"):
        load_config(write(tmp_path, body))
    cfg = load_config(write(tmp_path, "allowed_target_prefixes: [collections]\n" + body))
    assert instantiate(cfg.model) == {"a": 1}
    cfg = load_config(write(tmp_path, body), allowed_target_prefixes=["collections."])
    assert instantiate(cfg.model) == {"a": 1}
    cfg = load_config(write(tmp_path, body), ["--allowed_target_prefixes=[collections.]"])
    assert cfg.allowed_target_prefixes == ["collections."]
    # extending does not drop the defaults
    assert set(cfg.target_prefixes()) >= {"collections.", "torch.nn.", "hybridtrain."}


def test_instantiate_nested_partial_and_call_site_args(tmp_path):
    import torch

    cfg = load_config(write(tmp_path, """\
        model:
          _target_: torch.nn.Sequential
          _args_:
            - _target_: torch.nn.Linear
              in_features: 4
              out_features: 3
            - _target_: torch.nn.ReLU
        optimizer:
          _target_: torch.optim.SGD
          _partial_: true
          lr: 0.5
        lr_scheduler:
          _target_: torch.optim.lr_scheduler.StepLR
          step_size: 2
        """))
    model = instantiate(cfg.model)
    assert isinstance(model[0], torch.nn.Linear) and model[0].out_features == 3
    make_opt = instantiate(cfg.optimizer)
    assert isinstance(make_opt, functools.partial)
    opt = make_opt(model.parameters())
    assert opt.param_groups[0]["lr"] == 0.5
    opt2 = instantiate(cfg.optimizer, lr=0.25)(model.parameters())  # call site wins
    assert opt2.param_groups[0]["lr"] == 0.25
    sched = instantiate(cfg.lr_scheduler, opt)
    assert sched.step_size == 2
    assert instantiate(cfg.peft) is None


def test_instantiate_unknown_kwarg_suggests_parameter(tmp_path):
    path = write(tmp_path, "model:\n  _target_: torch.nn.Linear\n  in_features: 4\n"
                           "  out_featurs: 2\n")
    cfg = load_config(path)
    with pytest.raises(ValueError, match=r"unknown argument 'out_featurs' for torch.nn.Linear at "
                                         r"'model.out_featurs' \(.*recipe.yaml:4\); did you mean "
                                         r"'out_features'"):
        instantiate(cfg.model)
    cfg = load_config(write(tmp_path, "model:\n  _target_: torch.nn.Linear\n  in_features: 4\n"))
    with pytest.raises(ValueError, match="cannot call torch.nn.Linear.*out_features"):
        instantiate(cfg.model)  # missing required argument
    cfg = load_config(write(tmp_path, "model:\n  _target_: torch.nn.Lineer\n"))
    with pytest.raises(ValueError, match="has no attribute 'Lineer'; did you mean 'Linear'"):
        instantiate(cfg.model)


def test_underscore_top_level_keys_hold_yaml_anchors(tmp_path):
    cfg = load_config(write(tmp_path, """\
        _base: &base
          in_features: 4
        model:
          <<: *base
          _target_: torch.nn.Linear
          out_features: 2
        """))
    assert "_base" not in cfg
    assert cfg.model == {"_target_": "torch.nn.Linear", "in_features": 4, "out_features": 2}


def test_settings_that_contradict_each_other_are_named_with_where(tmp_path, caplog):
    path = write(tmp_path, "training:\n  max_steps: 10\n  val_every_steps: 50\n"
                           "lr_scheduler:\n  lr_warmup_steps: 20\n"
                           "validation_dataset: {path: v.jsonl}\n"
                           "packing: {enabled: true, pack_size: 512}\n"
                           "dataset: {path: t.jsonl, seq_length: 1024}\n")
    load_config(path)
    said = [r.getMessage() for r in caplog.records]
    assert any(f"lr_scheduler.lr_warmup_steps=20 ({path}:5)" in m and "never reaches" in m
               for m in said), said
    assert any(f"training.val_every_steps=50 ({path}:3)" in m for m in said)
    assert any("dataset.seq_length=1024" in m and "packing.pack_size=512" in m for m in said)
    caplog.clear()
    load_config(path)  # said once per process
    assert not [r for r in caplog.records if "recipe:" in r.getMessage()]
    load_config(write(tmp_path, "training:\n  max_steps: 10\n"))
    assert not caplog.records


def test_key_errors_point_at_the_recipe_file_by_its_path(tmp_path):
    with pytest.raises(ValueError, match="src/hybridtrain/config/recipe.py"):
        load_config(write(tmp_path, "training: {}\n"), ["--trainng.max_steps=3"])
