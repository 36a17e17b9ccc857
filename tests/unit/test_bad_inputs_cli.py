"""Bad data files through `hybridtrain finetune`: each one is refused with a message that names
the file (and line, and why), never a traceback from a library."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from hybridtrain.cli import main

CTX = "The Normans gave their name to Normandy, a region in France, in the 10th century."


def squad_rec(i, question="Where is Normandy?"):
    return {"id": f"q{i}", "context": CTX, "question": question,
            "answers": {"text": ["France"], "answer_start": [CTX.index("France")]}}


def chat_rec(answer="In France."):
    return {"messages": [{"role": "user", "content": "Where is Normandy?"},
                         {"role": "assistant", "content": answer}]}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from hybridtrain.data import build_bpe_tokenizer, synthetic_texts

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    build_bpe_tokenizer(synthetic_texts(50, seed=0) + [CTX] * 3, out, vocab_size=300)
    return out


def finetune(tmp_path, tok_dir, dataset, *extra, **sections):
    """Runs `hybridtrain finetune` on the tiny model with ``dataset`` (a recipe section) for 2
    steps into tmp_path/run; returns its exit status."""
    recipe = {
        "tokenizer": {"_target_": "hybridtrain.data.load_tokenizer", "path": str(tok_dir)},
        "model": {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM",
                  "config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config",
                             "kind": "mixed", "vocab_size": 300}},
        "dataset": {"cache_dir": str(tmp_path / "cache"), **dataset},
        "training": {"device": "cpu", "dtype": "float32", "global_batch_size": 2,
                     "micro_batch_size": 1, "max_steps": 2},
        "metrics": {"progress_bar": False, "plot": False, "peak_tflops": 1.0},
        **sections,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return main(["finetune", "-c", str(path), f"--checkpoint.dir={tmp_path / 'run'}", *extra])


SQUAD = "hybridtrain.data.build_squad_dataset"
CHAT = "hybridtrain.data.build_chat_dataset"


@pytest.mark.parametrize("cache", [True, False])
def test_empty_data_file_is_an_empty_dataset_error(tmp_path, tok_dir, capsys, cache):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    extra = [] if cache else ["--dataset.cache_dir=false"]
    assert finetune(tmp_path, tok_dir, {"_target_": SQUAD, "path": str(data)}, *extra) == 2
    err = capsys.readouterr().err
    assert f"{data}: empty dataset: the data holds no records" in err
    assert "Traceback" not in err and "IndexError" not in err


def test_every_squad_answer_too_long_says_how_many_and_why(tmp_path, tok_dir, capsys):
    data = write_jsonl(tmp_path / "train.jsonl",
                       [squad_rec(i, "Where is Normandy? " * 20) for i in range(4)])
    code = finetune(tmp_path, tok_dir, {"_target_": SQUAD, "path": str(data), "seq_length": 32})
    err = capsys.readouterr().err
    assert code == 2
    assert (f"{data}: empty dataset: no examples left after filtering: 4 records read, "
            f"dropped: 4 too_long") in err and "raise seq_length" in err
    # the same files again (the cache holds no empty entry): the same message
    assert finetune(tmp_path, tok_dir, {"_target_": SQUAD, "path": str(data),
                                        "seq_length": 32}) == 2
    assert "4 records read, dropped: 4 too_long" in capsys.readouterr().err


def test_every_chat_record_cut_before_its_answer(tmp_path, tok_dir, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", [chat_rec()] * 3)
    code = finetune(tmp_path, tok_dir, {"_target_": CHAT, "path": str(data), "seq_length": 8})
    err = capsys.readouterr().err
    assert code == 2
    assert (f"{data}: empty dataset: no examples left after filtering: 3 records read, "
            f"dropped: 3 no_supervised_tokens_after_truncation") in err


def test_chat_record_without_an_assistant_turn_names_the_line(tmp_path, tok_dir, capsys):
    rec = {"messages": [{"role": "user", "content": "Where is Normandy?"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [rec, rec])
    assert finetune(tmp_path, tok_dir, {"_target_": CHAT, "path": str(data)}) == 2
    assert f"{data} line 1: the conversation has no assistant turn" in capsys.readouterr().err


def test_a_directory_of_several_splits_is_read_by_split(tmp_path, tok_dir, capsys):
    """train.jsonl + validation.jsonl in one folder: `dataset` reads train, `validation_dataset`
    validation (and the log says which files); never both as one dataset."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [squad_rec(i) for i in range(6)])
    write_jsonl(data / "validation.jsonl", [squad_rec(i) for i in range(3)])
    section = {"_target_": SQUAD, "path": str(data), "seq_length": 64}
    assert finetune(tmp_path, tok_dir, section, "--training.val_every_steps=1",
                    validation_dataset={**section, "cache_dir": str(tmp_path / "cache")}) == 0
    err = capsys.readouterr().err
    for line in ("reading train.jsonl", "6 examples kept of 6 read", "reading validation.jsonl",
                 "3 examples kept of 3 read"):
        assert f"INFO hybridtrain.data: {data}: {line}\n" in err
    # a folder of other splits only (train and test) for the validation section: refused
    (data / "validation.jsonl").rename(data / "test.jsonl")
    code = finetune(tmp_path, tok_dir, section, f"--checkpoint.dir={tmp_path / 'run2'}",
                    validation_dataset=section)
    err = capsys.readouterr().err
    assert code == 2 and (f"{data} holds the data files of several splits (test.jsonl, "
                          "train.jsonl) and `split` is not set") in err
    assert not (tmp_path / "run2").exists()


def test_a_directory_of_several_splits_without_a_section(tmp_path, tok_dir):
    """A builder called without the recipe's hint refuses naming the files; `split` chooses."""
    from hybridtrain.data import DataError, build_chat_dataset

    write_jsonl(tmp_path / "train.jsonl", [chat_rec()] * 2)
    write_jsonl(tmp_path / "dev.jsonl", [chat_rec("Yes.")])
    with pytest.raises(DataError, match=r"several splits \(dev\.jsonl, train\.jsonl\)"):
        build_chat_dataset(tmp_path, str(tok_dir), cache_dir=False)
    assert len(build_chat_dataset(tmp_path, str(tok_dir), split="dev", cache_dir=False)) == 1
    assert len(build_chat_dataset(tmp_path, str(tok_dir), default_split="validation",
                                  cache_dir=False)) == 1
    # shards of one split are one dataset
    (tmp_path / "dev.jsonl").rename(tmp_path / "train-00001.jsonl")
    assert len(build_chat_dataset(tmp_path, str(tok_dir), cache_dir=False)) == 3


LATIN1 = "caf\xe9".encode("latin-1")  # not UTF-8


@pytest.mark.parametrize("kind", ["jsonl", "json", "chat_template", "tokenizer_config",
                                  "tokenizer_json"])
def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path, tok_dir, capsys, kind):
    import shutil

    good = write_jsonl(tmp_path / "chat.jsonl", [chat_rec()] * 2)
    section = {"_target_": CHAT, "path": str(good)}
    tokenizer = tok_dir
    if kind == "jsonl":  # line 2 of a data file
        bad = tmp_path / "chat.jsonl"
        bad.write_bytes(good.read_bytes() + b'{"messages": "' + LATIN1 + b'"}\n')
        where = f"{bad}: line 3: column 18"
    elif kind == "json":
        bad = tmp_path / "squad.json"
        bad.write_bytes(b'{"data": [\n {"title": "' + LATIN1 + b'"}]}\n')
        section, where = {"_target_": SQUAD, "path": str(bad)}, f"{bad}: line 2: column 16"
    elif kind == "chat_template":
        bad = tmp_path / "t.jinja"
        bad.write_bytes(b"{% for m in messages %}\n" + LATIN1 + b"{{ m.content }}{% endfor %}")
        section["chat_template_path"], where = str(bad), f"{bad}: line 2: column 4"
    else:  # a file of the tokenizer folder
        tokenizer = tmp_path / "tok"
        shutil.copytree(tok_dir, tokenizer)
        bad = tokenizer / ("tokenizer_config.json" if kind == "tokenizer_config"
                           else "tokenizer.json")
        text = bad.read_bytes()
        bad.write_bytes(text.replace(b'"', b'"' + LATIN1, 1))
        where = f"{bad}: line 2: column 7"  # the first key
    assert finetune(tmp_path, tokenizer, section) == 2
    err = capsys.readouterr().err
    assert f"{where}: bytes b'\\xe9' are not UTF-8" in err, err[-600:]
    assert "Traceback" not in err


def test_a_recipe_that_is_not_utf8_names_its_line(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"training:\n  max_steps: 2  # " + LATIN1 + b"\n")
    assert main(["finetune", "-c", str(path), "--print-config"]) == 2
    assert f"{path}: line 2: column 22: bytes b'\\xe9' are not UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["finetune", "dpo"])
@pytest.mark.parametrize("missing", ["dataset.path", "validation_dataset.path",
                                     "dataset.chat_template_path", "tokenizer.path"])
def test_a_missing_input_fails_before_anything_is_built(tmp_path, tok_dir, capsys, command, missing):
    """A missing data file, chat template or tokenizer folder is refused before the tokenizer and
    the model are built (the order of events, not the time), naming the key and its line."""
    from tests.helpers.models import BUILD_EVENTS

    train = write_jsonl(tmp_path / "train.jsonl", [chat_rec()] * 4)
    data = {"_target_": CHAT, "path": str(train), "seq_length": 64}
    recipe = {
        "allowed_target_prefixes": ["tests.helpers."],
        "tokenizer": {"_target_": "tests.helpers.models.recorded_tokenizer", "path": str(tok_dir)},
        "model": {"_target_": "tests.helpers.models.recorded_model", "vocab_size": 300},
        "dataset": dict(data), "validation_dataset": dict(data),
        "training": {"device": "cpu", "max_steps": 1},
        "metrics": {"progress_bar": False, "plot": False},
    }
    section, key = missing.split(".")
    recipe[section][key] = str(tmp_path / "nowhere" / "x")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    BUILD_EVENTS.clear()
    assert main([command, "-c", str(path), f"--checkpoint.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"{missing} '{tmp_path / 'nowhere' / 'x'}': no such" in err and f"{path}:" in err
    assert BUILD_EVENTS == []


def test_the_build_recorder_sees_a_complete_recipe_build(tmp_path, tok_dir):
    """The control of the test above: with every input present, tokenizer then model are built."""
    from tests.helpers.models import BUILD_EVENTS
    from hybridtrain.training.builder import build

    train = write_jsonl(tmp_path / "train.jsonl", [chat_rec()] * 4)
    BUILD_EVENTS.clear()
    build({"allowed_target_prefixes": ["tests.helpers."],
           "tokenizer": {"_target_": "tests.helpers.models.recorded_tokenizer", "path": str(tok_dir)},
           "model": {"_target_": "tests.helpers.models.recorded_model", "vocab_size": 300},
           "dataset": {"_target_": CHAT, "path": str(train), "seq_length": 64},
           "training": {"device": "cpu", "global_batch_size": 2, "micro_batch_size": 1}})
    assert BUILD_EVENTS == ["tokenizer", "model"]


def test_a_tokenizer_folder_without_a_tokenizer_names_the_key(tmp_path):
    """E.g. a model recipe whose folder default holds only config.json (enough to plan)."""
    from hybridtrain.config import load_config
    from hybridtrain.data.io import DataError
    from hybridtrain.training.builder import check_input_paths

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"tokenizer:\n  _target_: hybridtrain.data.load_tokenizer\n  path: {tmp_path / 'model'}\n")
    with pytest.raises(DataError, match=r"r.yaml:3: tokenizer.path .* holds no tokenizer"):
        check_input_paths(load_config(recipe))


def _tokenizer_with_code(tok_dir, folder, marker, keep_class: bool):
    """A copy of ``tok_dir`` with a Python file that would create ``marker`` and an ``auto_map``
    naming it (with or without a standard ``tokenizer_class`` beside it)."""
    import shutil

    shutil.copytree(tok_dir, folder)
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class Evil(PreTrainedTokenizerFast):\n    pass\n")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "evil.Evil"]}
    if not keep_class:
        cfg.pop("tokenizer_class", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("where", ["tokenizer", "dataset"])
def test_a_recipe_cannot_switch_on_trust_remote_code(tmp_path, tok_dir, capsys, where):
    marker = tmp_path / "pwned"
    code_tok = _tokenizer_with_code(tok_dir, tmp_path / "tok", marker, keep_class=False)
    data = write_jsonl(tmp_path / "train.jsonl", [squad_rec(i) for i in range(4)])
    dataset = {"_target_": SQUAD, "path": str(data), "tokenizer": str(code_tok)}
    tokenizer = {"_target_": "hybridtrain.data.load_tokenizer", "path": str(code_tok)}
    (dataset if where == "dataset" else tokenizer)["trust_remote_code"] = True
    code = finetune(tmp_path, tok_dir, dataset, tokenizer=tokenizer)
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists()
    assert f"'{where}.trust_remote_code: True'" in err and "recipe.yaml" in err, err[-2000:]
    assert "is refused" in err and "Traceback" not in err
    # nor from the command line
    dataset.pop("trust_remote_code", None), tokenizer.pop("trust_remote_code", None)
    assert finetune(tmp_path, tok_dir, dataset, f"--+{where}.trust_remote_code=true",
                    tokenizer=tokenizer) == 2
    assert not marker.exists() and "is refused" in capsys.readouterr().err


def test_a_tokenizer_folder_that_asks_for_its_own_code_never_runs_it(tmp_path, tok_dir, capsys):
    from hybridtrain.data import build_squad_dataset, load_tokenizer
    from hybridtrain.data.io import DataError

    marker = tmp_path / "pwned"
    needs_code = _tokenizer_with_code(tok_dir, tmp_path / "needs", marker, keep_class=False)
    with pytest.raises(DataError, match=r"asks to run its own Python code \(auto_map .*evil.Evil"):
        load_tokenizer(needs_code)
    # with a standard class beside the auto_map: loads as that class, the file never runs
    has_class = _tokenizer_with_code(tok_dir, tmp_path / "has", marker, keep_class=True)
    assert type(load_tokenizer(has_class)).__module__.startswith("transformers.")
    # asked for through the Python API: refused, also through a dataset builder's forwarding
    for call in (lambda: load_tokenizer(has_class, trust_remote_code=True),
                 lambda: load_tokenizer(has_class, local_files_only=False),
                 lambda: load_tokenizer(has_class, revision="main"),
                 lambda: build_squad_dataset(tmp_path / "x.jsonl", str(has_class),
                                             trust_remote_code=True)):
        with pytest.raises(DataError, match="is refused"):
            call()
    # through the CLI: the tokenizer section names the folder
    data = write_jsonl(tmp_path / "train.jsonl", [squad_rec(i) for i in range(4)])
    assert finetune(tmp_path, tok_dir, {"_target_": SQUAD, "path": str(data)},
                    tokenizer={"_target_": "hybridtrain.data.load_tokenizer",
                               "path": str(needs_code)}) == 2
    assert "asks to run its own Python code" in capsys.readouterr().err
    assert not marker.exists()


def test_a_missing_tokenizer_json_says_so(tmp_path, tok_dir):
    import shutil

    from hybridtrain.data import load_tokenizer
    from hybridtrain.data.io import DataError

    folder = tmp_path / "tok"
    shutil.copytree(tok_dir, folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=rf"{folder / 'tokenizer.json'} is missing .*copy the "
                                        "model's tokenizer.json"):
        load_tokenizer(folder)


@pytest.mark.parametrize("how", ["recipe", "blank", "env", "command line"])
def test_an_empty_checkpoint_dir_is_refused_naming_where(tmp_path, capsys, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNSET_RUN_DIR", raising=False)
    mine = tmp_path / "config.yaml"
    mine.write_text("the user's own file\n")
    value = {"recipe": "''", "blank": "'   '", "env": "${env:UNSET_RUN_DIR,}",
             "command line": "somewhere"}[how]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  _target_: hybridtrain.models.nemotron_h.NemotronHForCausalLM\n"
                      f"checkpoint:\n  dir: {value}\n")
    extra = ["--checkpoint.dir="] if how == "command line" else []
    assert main(["finetune", "-c", str(recipe), *extra]) == 2
    err = capsys.readouterr().err
    where = "command-line override '--checkpoint.dir='" if how == "command line" else f"{recipe}:4"
    assert "'checkpoint.dir' is empty" in err and where in err, err
    assert mine.read_text() == "the user's own file\n"


def test_convert_to_a_file_or_under_one_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "run"
    ckpt.mkdir()
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for out, message in ((a_file, "is a file, not a folder"),
                         (a_file / "out", f"lies under the file {a_file}")):
        assert main(["convert", str(ckpt), str(out)]) == 2
        err = capsys.readouterr().err
        assert f"convert OUT_HF_DIR {out}: {message}" in err and "Traceback" not in err, err
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'nope'} is not a checkpoint" in capsys.readouterr().err
    assert main(["merge", "--base", str(ckpt), "--adapter", str(ckpt), "--out",
                 str(a_file / "m")]) == 2
    assert f"--out {a_file / 'm'}: lies under the file {a_file}" in capsys.readouterr().err


@pytest.mark.parametrize("override", ["--training.max_val_steps=-1", "--training.max_val_steps=0",
                                      "--training.ckpt_every_steps=-1",
                                      "--training.val_every_steps=-2",
                                      "--checkpoint.keep_last=0", "--dataloader.num_workers=-1"])
def test_a_count_that_would_silently_skip_work_is_refused(tmp_path, override):
    from hybridtrain.config import ConfigError, load_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("training:\n  max_steps: 2\n")
    key = override[2:].split("=")[0]
    with pytest.raises(ConfigError, match=rf"'{key}' must be >= \d+, got -?\d+ in command-line"):
        load_config(recipe, [override])


@pytest.mark.parametrize("overrides,message", [
    (["--evaluation.temperature=-0.5"], "'evaluation.temperature' must be >= 0, got -0.5"),
    (["--evaluation.do_sample=true", "--evaluation.temperature=0"], "temperature 0 is greedy"),
    (["--evaluation.top_p=1.5"], "'evaluation.top_p' must be in (0, 1], got 1.5"),
])
def test_evaluation_sampling_out_of_range_is_refused_at_load(tmp_path, overrides, message):
    from hybridtrain.config import ConfigError, load_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("evaluation:\n  num_examples: 2\n")
    with pytest.raises(ConfigError, match=re.escape(message) + ".*command-line"):
        load_config(recipe, overrides)
