"""The ``_target_`` allow-list: decided by what the resolved object is, code-loading entry points
refused unless listed, no module hopping through attributes; also through the CLI."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hybridtrain.config import ConfigError, instantiate
from hybridtrain.config.targets import DEFAULT_ALLOWED_PREFIXES


def _refused(target: str, prefixes=DEFAULT_ALLOWED_PREFIXES) -> str:
    from hybridtrain.config import build_config

    cfg = None
    try:
        cfg = build_config({"allowed_target_prefixes": [p for p in prefixes
                                                        if p not in DEFAULT_ALLOWED_PREFIXES],
                            "model": {"_target_": target, "_partial_": True}})
        instantiate(cfg.model)
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"{target} was allowed")


@pytest.mark.parametrize("target", [
    "torch.serialization.os.system",            # a module reached as another module's attribute
    "hybridtrain.cli.os.system",
    "torch.nn.modules.module.torch.load",
    "torch.nn.modules.module.OrderedDict",      # defined in collections
])
def test_attribute_paths_are_refused(target):
    msg = _refused(target)
    assert target in msg


@pytest.mark.parametrize("target", [
    "torch.load", "torch.hub.load", "torch.jit.load", "torch.utils.cpp_extension.load",
    "torch.compile", "torch.package.PackageImporter", "transformers.AutoModel.from_pretrained",
    "transformers.dynamic_module_utils.get_class_from_dynamic_module",
    "datasets.load_dataset", "hybridtrain.recipes.finetune.run", "hybridtrain.fileio.atomic_write",
    "hybridtrain.config.load_config",
])
def test_code_loading_entry_points_are_refused_even_under_a_wide_prefix(target):
    top = target.split(".")[0] + "."
    msg = _refused(target, DEFAULT_ALLOWED_PREFIXES + (top,))
    assert "code-loading entry point" in msg and "explicitly" in msg


_PAYLOADS = ("tests.helpers.target_payloads.",)


@pytest.mark.parametrize("target", [
    # dunder and private hops: through a module's globals or builtins
    "hybridtrain.cli.__builtins__.exec",
    "hybridtrain.config.__builtins__.get",
    "hybridtrain.data.__spec__.loader.exec_module",
    "tests.helpers.target_payloads.build.__globals__.get",
    "tests.helpers.target_payloads._private",
    "tests.helpers.target_payloads.Holder.make.__func__",
    # bound builtin methods (no defining module) and stdlib builtins re-exported
    "tests.helpers.target_payloads.put",
    "tests.helpers.target_payloads.get",
    "tests.helpers.target_payloads.join",
    "tests.helpers.target_payloads.system",
    "tests.helpers.target_payloads.Holder.run",
    # re-exported stdlib modules and classes re-exported from torch / stdlib
    "tests.helpers.target_payloads.os.system",
    "tests.helpers.target_payloads.subprocess.run",
    "tests.helpers.target_payloads.Tensor",
    "tests.helpers.target_payloads.OrderedDict",
    # getattr chains through instances
    "tests.helpers.target_payloads.logger.info",
    "tests.helpers.target_payloads.REGISTRY.update",
    "tests.helpers.target_payloads.Holder.env.setdefault",
])
def test_payload_paths_are_refused(target):
    msg = _refused(target, DEFAULT_ALLOWED_PREFIXES + _PAYLOADS)
    assert target in msg


def test_payload_module_legitimate_targets_resolve():
    from hybridtrain.config import resolve_target
    from tests.helpers import target_payloads as tp

    assert resolve_target("tests.helpers.target_payloads.build", _PAYLOADS) is tp.build
    assert resolve_target("tests.helpers.target_payloads.Holder", _PAYLOADS) is tp.Holder
    assert resolve_target("tests.helpers.target_payloads.Holder.make", _PAYLOADS)(3) == 3


def test_payload_recipe_runs_nothing(tmp_path):
    """A recipe of only allowed-prefix targets that tries to rebind a builtin and run a shell
    command is refused before anything runs."""
    from hybridtrain.config import build_config

    marker = tmp_path / "pwned"
    for target in ("hybridtrain.cli.__builtins__.__setitem__",
                   "tests.helpers.target_payloads.put", "tests.helpers.target_payloads.system",
                   "tests.helpers.target_payloads.os.system"):
        with pytest.raises(ConfigError, match="target"):
            cfg = build_config({"allowed_target_prefixes": list(_PAYLOADS),
                                "model": {"_target_": target, "_args_": [f"touch {marker}"]}})
            instantiate(cfg.model)
        assert not marker.exists()


def test_every_shipped_target_resolves():
    """The targets the examples and the recipe's defaults name keep resolving."""
    import pathlib

    import yaml

    from hybridtrain.config import resolve_target

    root = pathlib.Path(__file__).resolve().parents[2]

    def targets(node):
        if isinstance(node, dict):
            if isinstance(node.get("_target_"), str):
                yield node["_target_"]
            for v in node.values():
                yield from targets(v)
        elif isinstance(node, list):
            for v in node:
                yield from targets(v)

    seen = set()
    for recipe in sorted((root / "examples").glob("*.yaml")):
        doc = yaml.safe_load(recipe.read_text())
        prefixes = DEFAULT_ALLOWED_PREFIXES + tuple((doc or {}).get("allowed_target_prefixes")
                                                    or ())
        for t in targets(doc):
            if t not in seen:
                seen.add(t)
                assert callable(resolve_target(t, prefixes)), (recipe, t)
    assert len(seen) >= 5


def test_narrow_defaults_and_explicit_listing():
    assert "torch." not in DEFAULT_ALLOWED_PREFIXES
    assert "not allowed" in _refused("torch.load")  # torch. itself is not allowed by default
    # an explicit entry allows exactly that entry point
    from hybridtrain.config import build_config

    cfg = build_config({"allowed_target_prefixes": ["torch.hub."],
                        "model": {"_target_": "torch.hub.list", "_partial_": True}})
    assert callable(instantiate(cfg.model))
    # what recipes use stays allowed
    for t in ("torch.optim.AdamW", "torch.nn.Linear", "torch.optim.lr_scheduler.StepLR",
              "hybridtrain.models.nemotron_h.NemotronHForCausalLM.from_pretrained"):
        assert callable(instantiate({"_target_": t, "_partial_": True}))


def test_cli_refuses_shell_command_through_attribute_path(tmp_path):
    """``hybridtrain finetune`` refuses each recipe naming a shell command through an allowed
    prefix's attribute path (exit 2, the target named, nothing run); one child process runs the
    CLI's ``main`` on each recipe in turn (one torch import instead of one per recipe)."""
    marker = tmp_path / "pwned"
    targets = ("torch.serialization.os.system", "hybridtrain.cli.os.system",
               "torch.nn.modules.module.os.system")
    recipes = []
    for i, target in enumerate(targets):
        recipe = tmp_path / f"r{i}.yaml"
        recipe.write_text(textwrap.dedent(f"""\
            allowed_target_prefixes: [torch.]
            model:
              _target_: {target}
              command: "touch {marker}"
            checkpoint: {{dir: {tmp_path / 'out'}}}
            """))
        recipes.append(str(recipe))
    code = ("import sys\nfrom hybridtrain.cli import main\nfor r in sys.argv[1:]:\n"
            "    print('=== recipe', file=sys.stderr, flush=True)\n"
            "    print('rc', main(['finetune', '-c', r]), file=sys.stderr, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code, *recipes], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    runs = r.stderr.split("=== recipe\n")[1:]
    assert len(runs) == len(targets), r.stderr
    for target, err in zip(targets, runs):
        assert err.rstrip().endswith("rc 2"), err
        assert target in err, err
    assert not marker.exists()
