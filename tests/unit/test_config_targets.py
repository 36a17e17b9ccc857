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
    marker = tmp_path / "pwned"
    recipe = tmp_path / "r.yaml"
    for target in ("torch.serialization.os.system", "hybridtrain.cli.os.system",
                   "torch.nn.modules.module.os.system"):
        recipe.write_text(textwrap.dedent(f"""\
            allowed_target_prefixes: [torch.]
            model:
              _target_: {target}
              command: "touch {marker}"
            checkpoint: {{dir: {tmp_path / 'out'}}}
            """))
        r = subprocess.run([sys.executable, "-m", "hybridtrain", "finetune", "-c", str(recipe)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stderr
        assert not marker.exists()
        assert target in r.stderr, r.stderr
