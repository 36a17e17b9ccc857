"""Exported weights get the user's umask (safetensors and mkdtemp alone give 0600 / 0700)."""

from __future__ import annotations

import os
import stat

import pytest

from hybridtrain.fileio import apply_umask, current_umask
from hybridtrain.peft import apply_lora, save_peft_adapter

from test_lora import make_model


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _modes(folder):
    return {p: stat.S_IMODE(os.stat(os.path.join(folder, p)).st_mode)
            for p in ["."] + os.listdir(folder)}


def test_hf_and_adapter_exports_follow_the_umask(tmp_path, umask):
    assert current_umask() == umask
    m = make_model()
    m.save_pretrained(tmp_path / "hf")
    m.save_pretrained(tmp_path / "hf")  # re-export over an existing folder
    apply_lora(m, dim=4, alpha=8)
    save_peft_adapter(m, tmp_path / "adapter", None)
    for folder in ("hf", "adapter"):
        modes = _modes(tmp_path / folder)
        assert modes.pop(".") == 0o777 & ~umask, folder
        assert any(p.endswith(".safetensors") for p in modes)
        assert set(modes.values()) == {0o666 & ~umask}, (folder, modes)


def test_apply_umask(tmp_path, umask):
    (tmp_path / "d").mkdir(mode=0o700)
    (tmp_path / "d" / "f").write_text("x")
    os.chmod(tmp_path / "d" / "f", 0o600)
    apply_umask(tmp_path / "d")
    assert _modes(tmp_path / "d") == {".": 0o777 & ~umask, "f": 0o666 & ~umask}
