"""What ``hybridtrain generate`` accepts as ``--model`` and as a prompt (no model is built)."""

from __future__ import annotations

import json

import pytest

from hybridtrain.cli import main
from hybridtrain.recipes.generate import resolve_export


def _json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_a_lora_run_folder_resolves_to_its_adapter_not_the_step_config(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run"
    _json(base / "config.json", {"model_type": "nemotron_h"})
    step = run / "step_4"
    _json(step / "config.json", {"model_type": "nemotron_h"})  # the checkpoint's model config
    _json(step / "trainer_state.json", {"step": 4})
    _json(step / "adapter" / "adapter_config.json", {"base_model_name_or_path": str(base)})
    (run / "latest").write_text("step_4\n")
    want = (str(base), str(step / "adapter"))
    assert resolve_export(str(run)) == want and resolve_export(str(step)) == want
    assert resolve_export(str(step / "adapter")) == want
    assert resolve_export(str(base)) == (str(base), None)
    (step / "adapter" / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="checkpoint without an export.*hybridtrain convert"):
        resolve_export(str(run))


def test_an_empty_prompt_is_refused_where_it_enters(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", ""]) == 2
    assert "--prompt: the prompt is empty" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "  "}\n')
    assert main(["generate", "--model", str(tmp_path), "--prompts", str(prompts)]) == 2
    assert f"{prompts}:2: the prompt is empty" in capsys.readouterr().err
