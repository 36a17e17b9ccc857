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


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny Nemotron-H Hugging Face folder with its tokenizer."""
    from hybridtrain.data import build_bpe_tokenizer, synthetic_texts
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    out = tmp_path_factory.mktemp("gen") / "model"
    tok = build_bpe_tokenizer(synthetic_texts(40, seed=0), out, vocab_size=300)
    model = NemotronHForCausalLM(tiny_config(kind="mixed", vocab_size=len(tok)))
    model.save_pretrained(out)
    return out


def _generate(capsys, model_dir, *flags):
    code = main(["generate", "--model", str(model_dir), "--prompt", "the answer is",
                 "--max-new-tokens", "6", *flags])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_temperature_zero_is_greedy(tiny_model_dir, capsys):
    code, greedy, err = _generate(capsys, tiny_model_dir)
    assert code == 0, err
    for flags in (["--temperature", "0", "--seed", "1"], ["--temperature", "0", "--seed", "2"],
                  ["--temperature", "0", "--top-k", "3", "--top-p", "0.5", "--seed", "3"]):
        code, out, err = _generate(capsys, tiny_model_dir, *flags)
        assert code == 0, err
        assert json.loads(out)["completion"] == json.loads(greedy)["completion"], flags


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--top-k", "-2"], "--top-k must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_sampling_flags_out_of_range_are_refused_naming_the_flag(tmp_path, capsys, flags, message):
    # refused before the model is read: --model may be anything
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_max_new_tokens_past_the_context_or_the_memory_is_refused(tiny_model_dir, tmp_path,
                                                                  capsys):
    import shutil

    from hybridtrain.models.nemotron_h import NemotronHForCausalLM
    from hybridtrain.recipes.generate import check_generation_length

    code, _, err = _generate(capsys, tiny_model_dir, "--max-new-tokens", "100000000")
    assert code == 2 and "exceeds the model's context of 1024 tokens" in err, err
    assert "use --max-new-tokens 10" in err  # the prompt's length subtracted
    # a model with a huge context: the cache it would take is computed and refused
    big = tmp_path / "big"
    shutil.copytree(tiny_model_dir, big)
    cfg = json.loads((big / "config.json").read_text())
    cfg["max_position_embeddings"] = 10 ** 15
    (big / "config.json").write_text(json.dumps(cfg))
    code, _, err = _generate(capsys, big, "--max-new-tokens", str(10 ** 13))
    assert code == 2 and "--max-new-tokens 10000000000000: the decoding cache" in err, err
    assert "GiB" in err and "or a smaller --batch-size" in err
    # the number it suggests fits the same budget
    model = NemotronHForCausalLM.from_pretrained(big)
    import torch

    with pytest.raises(ValueError, match=r"use --max-new-tokens (\d+) or less") as e:
        check_generation_length(model, 2, 5, 10 ** 6, torch.device("cpu"), memory_fraction=1e-5)
    most = int(__import__("re").search(r"use --max-new-tokens (\d+)", str(e.value)).group(1))
    check_generation_length(model, 2, 5, most, torch.device("cpu"), memory_fraction=1e-5)


def test_generation_cache_bytes_are_what_prefill_allocates():
    import torch

    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
    from hybridtrain.models.nemotron_h.generation import prefill

    model = NemotronHForCausalLM(tiny_config(kind="mixed")).eval()
    with torch.no_grad():
        _, cache = prefill(model, torch.randint(0, 200, (3, 7)), None, max_length=57)
    held = cache.valid.nbytes + sum(t.nbytes for state in cache.layers.values()
                                    for t in vars(state).values() if isinstance(t, torch.Tensor))
    head_copy = 0 if cache.head_t is None else cache.head_t.nbytes
    bound = model.generation_cache_bytes(3, 57)
    head_bound = model.config.vocab_size * model.config.hidden_size * 4
    assert held + head_copy <= bound <= held + head_bound


def test_prompts_and_output_paths_are_checked_first(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    cases = [
        (["--prompts", str(tmp_path / "nope.jsonl")],
         f"--prompts {tmp_path / 'nope.jsonl'}: no such file"),
        (["--prompts", str(tmp_path)], f"--prompts {tmp_path}: is a folder; give a file"),
        (["--prompts", str(prompts), "--output", str(tmp_path)],
         f"--output {tmp_path}: is a folder; give a file name"),
        (["--prompts", str(prompts), "--output", str(tmp_path / "missing" / "o.jsonl")],
         f"its folder {tmp_path / 'missing'} does not exist; create the folder first"),
        (["--prompts", str(prompts), "--output", str(prompts / "o.jsonl")],
         f"{prompts} is a file, not a folder"),
        (["--prompt", "hi", "--adapter", str(tmp_path / "none")],
         f"--adapter {tmp_path / 'none'}: no such folder"),
    ]
    for flags, message in cases:
        assert main(["generate", "--model", str(tmp_path), *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (flags, err)


def test_non_utf8_prompts_name_the_file_and_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n')
    assert main(["generate", "--model", str(tmp_path), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}: line 2: column" in err and "not UTF-8" in err, err


@pytest.mark.parametrize("flags,message", [
    (["--model", "", "--prompt", "hi"], "--model is empty"),
    (["--model", "{tmp}", "--prompts", " "], "--prompts is empty"),
    (["--model", "{tmp}", "--prompt", "hi", "--output", ""], "--output is empty"),
    (["--model", "{tmp}", "--prompt", "hi", "--adapter", ""], "--adapter is empty"),
])
def test_an_empty_path_flag_is_refused_not_read_as_the_working_directory(tmp_path, capsys,
                                                                         flags, message):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    assert main(["generate", *flags]) == 2
    assert message in capsys.readouterr().err


def test_evaluate_names_its_own_flag_for_a_missing_checkpoint(tmp_path, capsys):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "examples" / "squad_tiny.yaml"
    assert main(["evaluate", "-c", str(recipe), "--checkpoint", str(tmp_path / "nope")]) == 2
    assert f"--checkpoint {tmp_path / 'nope'}: no such folder" in capsys.readouterr().err
