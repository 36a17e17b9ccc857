"""A sweep of bad inputs beyond the named cases of the other bad-input tests: each is refused
with a ``ValueError`` that names the file (line, key or tensor) and what to do, or read the way
a user expects; never a traceback from a library, nothing lost.

The readers and validators are called in-process (one table); the CLI runs only where its
exit status, its output or the run folder it leaves are what is checked."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import zlib

import pytest
import yaml
from tests.helpers.recipes import tiny_recipe

from hybridtrain.cli import main

BOM16 = "training:\n  max_steps: 3\n".encode("utf-16")


# -- inputs, one table ------------------------------------------------------------------------
def _recipe(text: str | bytes):
    def make(tmp):
        path = tmp / "recipe.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path
    return make


def _sparse_recipe(size: int):
    def make(tmp):
        path = tmp / "recipe.yaml"
        with open(path, "wb") as f:
            f.truncate(size)  # a hole: no disk used
        return path
    return make


def _symlink_loop(name: str):
    def make(tmp):
        os.symlink(name, tmp / name)
        return tmp / name
    return make


def load_recipe(path):
    from hybridtrain.config.loader import load_config

    return load_config(path)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` pixels (no pixel data)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0,
                                                              0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def _file(name: str, data: bytes | str):
    def make(tmp):
        path = tmp / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path
    return make


def _folder(name: str):
    def make(tmp):
        (tmp / name).mkdir()
        return tmp / name
    return make


def image_size(path):
    from hybridtrain.data.images import image_size as size

    return size(path)


def load_image(path):
    from hybridtrain.data.images import load_patches

    return load_patches(path, (2, 2), 4)


def _chat(*messages, **extra):
    return _file("chat.jsonl", json.dumps({"messages": list(messages), **extra}) + "\n")


USER = {"role": "user", "content": "Where is Normandy?"}
ANSWER = {"role": "assistant", "content": "In France."}


def read_chat(path):
    from hybridtrain.data import build_bpe_tokenizer, build_chat_dataset, synthetic_texts

    tok = build_bpe_tokenizer(synthetic_texts(20, seed=0), path.parent / "tok", vocab_size=280)
    return build_chat_dataset(str(path), tok, cache_dir=False)


def read_jsonl(path):
    from hybridtrain.data.io import iter_records

    return list(iter_records(path))


def read_prompts(path):
    from hybridtrain.recipes.generate import read_prompts as read

    return read(str(path))


def read_model_config(path):
    from hybridtrain.models.nemotron_h import NemotronHConfig

    return NemotronHConfig.from_json_file(path)


def weight_files(path):
    from hybridtrain.models.nemotron_h.hf_io import checkpoint_files

    return checkpoint_files(path)


def open_weights(path):
    from hybridtrain.fileio import open_safetensors

    with open_safetensors(path):
        pass


def index_weights(path):
    from hybridtrain.distributed.materialize import SafetensorsReader

    return SafetensorsReader([path])


def _synthetic(writer: str, **args):
    """Calls the synthetic-data ``writer`` (hybridtrain.data) with ``args`` into the folder."""
    def call(folder):
        import hybridtrain.data as data

        return getattr(data, writer)(folder / "out", **args)
    return call


def read_data(path):
    from hybridtrain.data.io import resolve_data_files

    return resolve_data_files(path)


DEEP = "[" * 100_000 + "]" * 100_000
# id -> (make the input in a folder, read it, the message (a regex))
CASES = {
    "recipe: YAML anchor cycle": (_recipe("training: &a\n  seed: [*a]\n"), load_recipe,
                                  r"recipe\.yaml: the YAML nests too deeply \(or an alias"),
    "recipe: a YAML list": (_recipe("- training\n- model\n"), load_recipe,
                            r"recipe\.yaml: a recipe must be a mapping of sections, got list"),
    "recipe: 1 GB (sparse)": (_sparse_recipe(1 << 30), load_recipe,
                              r"recipe\.yaml is 1,073,741,824 bytes, more than a recipe can be"),
    "recipe: NUL bytes": (_sparse_recipe(1000), load_recipe,
                          r"recipe\.yaml:1: invalid YAML: unacceptable character #x0000 \(a "
                          r"recipe is text: is it a binary file\?\)"),
    "recipe: NaN in a target's arguments": (
        _recipe("model:\n  _target_: hybridtrain.models.nemotron_h.NemotronHForCausalLM\n"
                "  config:\n    _target_: hybridtrain.models.nemotron_h.tiny_config\n"
                "    initializer_range: .nan\n"), load_recipe,
        r"'model\.config\.initializer_range' is NaN in .*recipe\.yaml:5; give a number"),
    "recipe: a symbolic-link loop": (_symlink_loop("loop.yaml"), load_recipe,
                                     r"loop\.yaml: cannot be read \(Too many levels of symbolic "
                                     r"links\); check the path"),
    "recipe: UTF-16": (_recipe(BOM16), load_recipe,
                       r"recipe\.yaml: the file is UTF-16 .*save it as UTF-8"),
    "recipe: tab indentation": (_recipe("training:\n\tmax_steps: 3\n"), load_recipe,
                                r"recipe\.yaml:2: invalid YAML: .*'\\t'"),
    "data: JSONL nested 100000 deep": (_file("d.jsonl", '{"a": ' + DEEP + "}\n"), read_jsonl,
                                       r"d\.jsonl: line 1: malformed JSON: the JSON nests too "
                                       r"deeply"),
    "data: JSON nested 100000 deep": (_file("d.json", DEEP), read_jsonl,
                                      r"d\.json: line 1: malformed JSON: the JSON nests too deeply"),
    "data: a symbolic-link loop": (_symlink_loop("d.jsonl"), read_data,
                                   r"d\.jsonl: a symbolic link that leads to itself or nowhere"),
    "data: UTF-16 JSONL": (_file("d.jsonl", '{"a": 1}\n'.encode("utf-16")), read_jsonl,
                           r"d\.jsonl: the file is UTF-16 .*save it as UTF-8"),
    "prompts: UTF-32": (_file("p.jsonl", '{"prompt": "x"}\n'.encode("utf-32")), read_prompts,
                        r"p\.jsonl: the file is UTF-32 .*save it as UTF-8"),
    "prompts: a JSON list, not JSONL": (_file("p.jsonl", '[{"prompt": "x"}]\n'), read_prompts,
                                        r"p\.jsonl:1: a record needs 'prompt'"),
    "chat: a tool call without a name": (
        _chat(USER, {"role": "assistant", "content": None,
                     "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
              ANSWER), read_chat, r"chat\.jsonl line 1 messages\[1\]: tool_calls\[0\] has no "
                                  r"function name"),
    "chat: tool-call arguments not JSON": (
        _chat(USER, {"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "f", "arguments": "{x: 1"}}]}, ANSWER), read_chat,
        r"tool_calls\[0\] 'arguments' is a string but not valid JSON"),
    "chat: every assistant turn empty": (_chat(USER, {"role": "assistant", "content": " "}),
                                         read_chat, r"chat\.jsonl: empty dataset: .*"
                                                    r"empty_assistant_content"),
    "chat: messages is text": (_file("chat.jsonl", json.dumps({"messages": "hi"}) + "\n"),
                               read_chat,
        r"chat\.jsonl line 1: 'messages' must be a list"),
    "chat: content a number": (_chat(USER, {"role": "assistant", "content": 5}), read_chat,
                               r"messages\[1\]: 'content' must be a string, got int"),
    "chat: tools not a list": (_chat(USER, ANSWER, tools={"name": "f"}), read_chat,
                               r"chat\.jsonl line 1: 'tools' must be a list of tool schemas"),
    "image: random bytes": (_file("x.png", os.urandom(256)), image_size,
                            r"image .*x\.png cannot be read: cannot identify image file"),
    "image: 20000x20000 (decompression bomb)": (_file("x.png", _png_header(20000, 20000)),
                                                load_image, r"image .*x\.png is refused: Image "
                                                            r"size \(400000000 pixels\) exceeds"
                                                            r".*Downscale it"),
    "image: a folder": (_folder("x.png"), image_size, r"image .*x\.png cannot be read: .*Is a "
                                                      r"directory"),
    "model config: not JSON": (_file("config.json", '{"hidden_size": 64,\n'), read_model_config,
                               r"config\.json: line 2: column 1: not valid JSON"),
    "weights: an index without a weight map": (
        _file("model.safetensors.index.json", '{"metadata": {}}'),
        lambda p: weight_files(p.parent), r"model\.safetensors\.index\.json: not a safetensors "
                                          r"index \(no 'weight_map' object\)"),
    "weights: a header longer than the file": (
        _file("model.safetensors", struct.pack("<Q", 1 << 40) + b"{}"), open_weights,
        r"model\.safetensors: not a readable safetensors file, truncated or corrupt"),
    "synthetic images: a negative count": (_folder("d"), _synthetic("write_synthetic_shapes",
                                                                    n=-5),
                                           r"write_synthetic_shapes n=-5: give a whole number "
                                           r"of records from 1 to 1,000,000"),
    "synthetic images: 10^12 (a typo)": (_folder("d"), _synthetic("write_synthetic_shapes",
                                                                  n=10 ** 12),
                                         r"n=1000000000000: give a whole number of records"),
    "synthetic images: text_only 2": (_folder("d"), _synthetic("write_synthetic_shapes", n=4,
                                                               text_only=2.0),
                                      r"text_only=2\.0: give the share of text-only records"),
    "synthetic SQuAD: zero questions": (_folder("d"), _synthetic("write_synthetic_squad",
                                                                 num_questions=0),
                                        r"num_questions=0: give a whole number of records"),
    "synthetic preferences: 2.5 pairs": (_folder("d"), _synthetic("write_synthetic_preferences",
                                                                  num_pairs=2.5),
                                         r"num_pairs=2\.5: give a whole number of records"),
    "weights: a header that is not JSON (sharded load)": (
        _file("model.safetensors", struct.pack("<Q", 4) + b"nope"), index_weights,
        r"model\.safetensors: corrupt safetensors file \(its header is not a JSON object\)"),
}


def _files(folder) -> dict:
    """What ``folder`` holds (a reader's own tokenizer, ``tok``, aside)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() and not p.is_symlink()
            and p.stat().st_size < 1 << 20 else None
            for p in folder.rglob("*") if p.relative_to(folder).parts[0] != "tok"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_refused_naming_it(case, tmp_path):
    make, read, message = CASES[case]
    path = make(tmp_path)
    before = _files(tmp_path)
    with pytest.raises(ValueError) as e:
        read(path)
    assert re.search(message, str(e.value)), str(e.value)
    assert _files(tmp_path) == before  # nothing written, nothing changed


def test_cmyk_and_16_bit_images_read_as_rgb(tmp_path):
    """A CMYK JPEG and a 16-bit grey PNG read as the RGB a viewer shows: 16-bit samples are
    scaled to 8 bits, not clipped to white."""
    import numpy as np
    from PIL import Image

    from hybridtrain.data.images import load_patches

    Image.new("CMYK", (16, 16), (0, 0, 0, 0)).save(tmp_path / "cmyk.jpg")
    Image.fromarray(np.full((16, 16), 0x8000, dtype=np.uint16)).save(tmp_path / "grey16.png")
    plain = dict(mean=(0, 0, 0), std=(1, 1, 1))
    white = load_patches(tmp_path / "cmyk.jpg", (2, 2), 4, **plain)
    assert white.shape == (4, 48) and white.min() > 0.95
    grey = load_patches(tmp_path / "grey16.png", (2, 2), 4, **plain)
    assert grey.shape == (4, 48) and abs(grey.mean().item() - 128 / 255) < 0.01


# -- runs through the CLI ---------------------------------------------------------------------
def _recipe_file(tmp_path, **sections) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(**sections)))
    return str(path)


ARGS = ["--training.ckpt_every_steps=1", "--training.val_every_steps=null",
        "--checkpoint.save_hf_at_end=false"]
LORA = {"dim": 2, "alpha": 4, "target_modules": ["q_proj"]}


def _snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(folder.rglob("*")) if not p.is_symlink()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A full and a LoRA run of one step on the tiny model (one checkpoint each)."""
    root = tmp_path_factory.mktemp("runs")
    for name, peft in (("full", None), ("lora", LORA)):
        (root / name).mkdir()
        recipe = _recipe_file(root / name, **({"peft": peft} if peft else {}))
        assert main(["finetune", "-c", recipe, f"--checkpoint.dir={root / name / 'run'}",
                     "--training.max_steps=1", *ARGS]) == 0
    return root


def _resume(tmp_path, run, *overrides, **sections) -> list[str]:
    return ["finetune", "-c", _recipe_file(tmp_path, **sections), f"--checkpoint.dir={run}",
            "--checkpoint.resume=auto", *ARGS, *overrides]


def test_a_resume_with_nothing_left_says_so_and_exits_0(runs, tmp_path, capsys):
    run = runs / "full" / "run"
    before = _snapshot(run)
    capsys.readouterr()
    assert main(_resume(tmp_path, run, "--training.max_steps=1")) == 0
    out = capsys.readouterr().out
    assert ("nothing to do: checkpoint step 1 >= training.max_steps 1; raise "
            "training.max_steps to train further") in out
    assert _snapshot(run) == before


def test_a_resume_of_a_run_by_epochs_with_nothing_left(runs, tmp_path, capsys):
    """64 samples of 8 a step: one step is 1/8 of an epoch."""
    run = runs / "full" / "run"
    before = _snapshot(run)
    assert main(_resume(tmp_path, run, "--training.max_steps=null",
                        "--training.num_epochs=0.125")) == 0
    assert ("nothing to do: checkpoint step 1 >= the 1 steps of training.num_epochs 0.125; "
            "raise training.num_epochs") in capsys.readouterr().out
    assert _snapshot(run) == before


def _no_data(monkeypatch):
    """Building the datasets fails the test: a refusal must come before it."""
    import hybridtrain.training.builder as builder

    def built(*args, **kwargs):
        raise AssertionError("the datasets were built before the refusal")
    monkeypatch.setattr(builder, "_build_data", built)


@pytest.mark.parametrize("name, overrides, sections, message", [
    ("another model's shapes", ["--+model.config.hidden_size=32"], {},
     r"tensor backbone\.embeddings\.weight: checkpoint \[256, 64\], this run \[256, 32\]"),
    ("another vocabulary", ["--+model.config.vocab_size=320"], {},
     r"tensor backbone\.embeddings\.weight: checkpoint \[256, 64\], this run \[320, 64\]"
     r"[\s\S]*vocab_size: checkpoint 256 vs run 320"),
    ("another LoRA layout", [], {"peft": {**LORA, "dim": 4}},
     r"tensor \S+q_proj\.lora_A: checkpoint \[2, 64\], this run \[4, 64\][\s\S]*"
     r"peft\.dim: checkpoint 2, this run 4"),
    ("LoRA on a full run's checkpoint", [], {"peft": LORA},
     r"tensor \S+q_proj\.lora_A: not in the checkpoint, this run \[2, 64\]"),
])
def test_a_checkpoint_that_cannot_continue_the_recipe(runs, tmp_path, capsys, monkeypatch, name,
                                                      overrides, sections, message):
    run = runs / ("lora" if "LoRA layout" in name else "full") / "run"
    before = _snapshot(run)
    _no_data(monkeypatch)
    assert main(_resume(tmp_path, run, "--training.max_steps=3", *overrides, **sections)) == 2
    err = capsys.readouterr().err
    assert f"refusing to resume from {run / 'step_1'}" in err and re.search(message, err), err
    assert "checkpoint.resume: null to start over" in err and "Traceback" not in err
    assert _snapshot(run) == before


@pytest.mark.parametrize("command", ["finetune", "dpo"])
def test_zero_epochs_without_max_steps_is_refused(tmp_path, capsys, command):
    """Refused when the recipe loads (the key's range), before anything is written."""
    recipe = _recipe_file(tmp_path) if command == "finetune" else "examples/dpo_tiny.yaml"
    out = tmp_path / "run"
    assert main([command, "-c", recipe, f"--checkpoint.dir={out}", "--training.max_steps=null",
                 "--training.num_epochs=0"]) == 2
    err = capsys.readouterr().err
    assert "'training.num_epochs' must be > 0, got 0" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("epochs", [0, -1, float("nan"), float("inf")])
def test_a_run_length_by_epochs_that_trains_nothing_is_refused(epochs):
    """The step scheduler, as a library builds it, never rounds such a length up to one step."""
    from hybridtrain.training.step_scheduler import StepScheduler

    with pytest.raises(ValueError, match=r"training\.num_epochs=.* with training\.max_steps=null "
                                         r"trains nothing; set training\.num_epochs to a number "
                                         r"of epochs > 0"):
        StepScheduler(8, 2, max_steps=None, num_epochs=epochs, num_train_samples=64)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, capsys):
    from hybridtrain.data import build_bpe_tokenizer, synthetic_texts

    build_bpe_tokenizer(synthetic_texts(40, seed=0), tmp_path / "tok", vocab_size=300)
    recipe = tiny_recipe(tokenizer={"_target_": "hybridtrain.data.load_tokenizer",
                                    "path": str(tmp_path / "tok")})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["finetune", "-c", str(tmp_path / "r.yaml"),
                 f"--checkpoint.dir={tmp_path / 'run'}", "--training.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"the tokenizer has \d+ tokens but model.config.vocab_size is 256 .*raise "
                     r"the model's vocab_size or use a smaller tokenizer", err), err
    assert "Traceback" not in err


def test_a_full_disk_during_an_export_keeps_the_previous_one(runs, tmp_path, capsys,
                                                             monkeypatch):
    """`hybridtrain convert` into a folder holding an earlier export: the disk fills while the
    weights are written; the earlier export is left whole and no partial folder remains."""
    import hybridtrain.models.nemotron_h.hf_io as hf_io

    out = tmp_path / "hf"
    assert main(["convert", str(runs / "full" / "run"), str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), args[1])
    monkeypatch.setattr(hf_io, "save_file", full)
    capsys.readouterr()
    assert main(["convert", str(runs / "full" / "run"), str(out)]) == 2
    err = capsys.readouterr().err
    assert "no space left on device while writing" in err and "free some space" in err, err
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("command", ["dpo", "grpo"])
def test_an_rl_resume_with_nothing_left_says_so_before_building(tmp_path, capsys, command):
    """A finished dpo/grpo run (its checkpoint faked: nothing is built before the check)."""
    run = tmp_path / "run"
    (run / "step_4").mkdir(parents=True)
    (run / "step_4" / "trainer_state.json").write_text(
        json.dumps({"step": 4, "extra": {"recipe": command}}))
    (run / "latest").write_text("step_4\n")
    before = _snapshot(run)
    assert main([command, "-c", f"examples/{command}_tiny.yaml", f"--checkpoint.dir={run}",
                 "--checkpoint.resume=auto", "--training.max_steps=4"]) == 0
    assert ("nothing to do: checkpoint step 4 >= training.max_steps 4; raise "
            "training.max_steps to train further") in capsys.readouterr().out
    assert _snapshot(run) == before
