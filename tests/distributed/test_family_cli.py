"""A model family from outside hybridtrain (tests/families/hybridtrain_dense, found through its
entry point; no line of src/ names it) through every command of the CLI: finetune (with the
evaluation section), convert, generate, evaluate and grpo in one process, and LoRA under FSDP2
and under 2 pipeline stages on 2 ranks (the command as a ``--nproc-per-node 2`` worker runs it:
``tests.helpers.distributed.run_cli``)."""

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.distributed import run_cli
from tests.helpers.families import DENSE, DENSE_PREFIXES, require_dense

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--metrics.progress_bar=false", "--metrics.peak_tflops=1.0", "--metrics.plot=false"]


def _recipe(tmp_path: Path, example: str, vocab_size: int, **sections) -> Path:
    """``examples/<example>`` with the dense family as its model, writing under ``tmp_path``."""
    text = (ROOT / "examples" / example).read_text().replace(
        f"outputs/{example.removesuffix('.yaml')}", str(tmp_path / "out")).replace(
        "num_questions: 2000", "num_questions: 200")  # a smaller world: a faster tokenizer
    recipe = yaml.safe_load(text)
    recipe["allowed_target_prefixes"] = DENSE_PREFIXES
    recipe["model"] = {**DENSE, "config": {**DENSE["config"], "vocab_size": vocab_size}}
    for name, values in sections.items():
        recipe[name] = None if values is None else {**recipe.get(name, {}), **values}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_dense_family_through_the_cli(tmp_path, capsys):
    require_dense()
    from hybridtrain.cli import main

    run = tmp_path / "run"
    recipe = _recipe(tmp_path, "squad_tiny.yaml", 512,
                     training={"max_steps": 2, "val_every_steps": 2, "ckpt_every_steps": 2},
                     evaluation={"num_examples": 2, "max_new_tokens": 3, "num_samples": 2},
                     checkpoint={"dir": str(run)})
    assert main(["finetune", "-c", str(recipe), *QUIET]) == 0
    val = [json.loads(line) for line in (run / "validation.jsonl").read_text().splitlines()]
    assert {"exact_match", "f1", "eval_examples"} <= set(val[-1]), val[-1]
    assert main(["convert", str(run), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "dense_test"
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "hf"), "--prompt", "Question: who?",
                 "--max-new-tokens", "3"]) == 0
    assert "Question: who?" in capsys.readouterr().out
    assert main(["evaluate", "-c", str(recipe), "--checkpoint", str(run)]) == 0
    assert "exact_match" in json.loads((run / "evaluation.jsonl").read_text().splitlines()[-1])

    grpo = _recipe(tmp_path, "grpo_tiny.yaml", 288, training={"max_steps": 1},
                   grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
                   checkpoint={"dir": str(tmp_path / "grpo")})
    assert main(["grpo", "-c", str(grpo), *QUIET]) == 0
    assert (tmp_path / "grpo" / "training.jsonl").read_text().strip()


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["--distributed.dp_shard=2", "--distributed.pp=2"],
                         ids=["fsdp2", "pp2"])
def test_dense_family_lora_on_two_workers(tmp_path, layout):
    """(the family does not decode through pipeline stages: no evaluation section under pp)"""
    require_dense()
    run = tmp_path / "run"
    recipe = _recipe(tmp_path, "squad_tiny.yaml", 512, peft={"dim": 4, "alpha": 8,
                                                             "match_all_linear": True},
                     evaluation={"num_examples": 2, "max_new_tokens": 2} if "dp" in layout
                     else None,
                     training={"max_steps": 2, "val_every_steps": 2, "ckpt_every_steps": 0},
                     checkpoint={"dir": str(run), "save_hf_at_end": True})
    run_cli(["finetune", "-c", str(recipe), layout, *QUIET], 2, tmp_path)
    assert (run / "step_2" / "adapter" / "adapter_model.safetensors").is_file()
