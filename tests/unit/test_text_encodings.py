"""Every reader of a text file a user gives reads UTF-8 with or without a byte-order mark (as
Windows editors write it). The readers are not listed here: each registers itself with
``hybridtrain.fileio.text_reader``, and the test feeds every registered one the same file with
and without the mark; a reader of a kind this file has no sample for fails the test."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import shutil
import types

import pytest

import hybridtrain
from hybridtrain.fileio import BOM, TEXT_READERS

CTX = "Les Normands ont donné leur nom à la Normandie, une région de France."


def _import_every_module() -> None:
    """Imports hybridtrain's modules, so that every reader has registered itself."""
    for mod in pkgutil.walk_packages(hybridtrain.__path__, "hybridtrain."):
        if mod.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(mod.name)
        except ImportError:  # an optional package's module (e.g. a GPU kernel)
            pass


_import_every_module()


def _write(path, text: str, bom: bool):
    path.write_bytes((BOM if bom else b"") + text.encode("utf-8"))
    return path


def _jsonl(records) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def _chat(answer="En France.") -> dict:
    return {"messages": [{"role": "user", "content": "Où est la Normandie ?"},
                         {"role": "assistant", "content": answer}]}


# kind -> sample(folder, bom, tokenizers) -> (path, other arguments of the reader)
def _text(d, bom, toks):
    return _write(d / "a.txt", "héllo\nwörld\n", bom), {}


def _json(d, bom, toks):
    return _write(d / "a.json", json.dumps({"data": [{"a": "é"}]}, ensure_ascii=False), bom), {}


def _jsonl_sample(d, bom, toks):
    return _write(d / "a.jsonl", _jsonl([{"a": "é"}, {"b": 2}]), bom), {}


def _recipe(d, bom, toks):
    return _write(d / "recipe.yaml", "# réglages\ntraining:\n  max_steps: 3\n", bom), {}


def _model_config(d, bom, toks):
    from hybridtrain.models.nemotron_h import tiny_config

    return _write(d / "config.json", tiny_config(kind="mixed").to_json_string(), bom), {}


def _tokenizer(d, bom, toks):
    folder = d / "tokenizer"
    shutil.copytree(toks["text"].name_or_path, folder)
    for f in folder.iterdir():
        _write(f, f.read_text(encoding="utf-8"), bom)
    return folder, {}


def _chat_template(d, bom, toks):
    from hybridtrain.data.tokenizer import CHATML_TEMPLATE

    return _write(d / "chat.jinja", CHATML_TEMPLATE, bom), {"tokenizer": toks["text"],
                                                             "chat_template": None}


def _prompts(d, bom, toks):
    return _write(d / "prompts.jsonl", _jsonl([{"prompt": "Où ?"}, _chat()]), bom), {}


def _squad(d, bom, toks):
    rec = {"id": "q0", "context": CTX, "question": "Où est la Normandie ?",
           "answers": {"text": ["France"], "answer_start": [CTX.index("France")]}}
    return _write(d / "squad.jsonl", _jsonl([rec] * 2), bom), {"tokenizer": toks["text"]}


def _chat_data(d, bom, toks):
    return _write(d / "chat.jsonl", _jsonl([_chat(), _chat("Oui.")]), bom), {
        "tokenizer": toks["text"]}


def _preference(d, bom, toks):
    rec = {"prompt": "Où est la Normandie ?", "chosen": "En France.", "rejected": "À Rome."}
    return _write(d / "pairs.jsonl", _jsonl([rec] * 2), bom), {"tokenizer": toks["text"]}


def _vision_chat(d, bom, toks):
    from hybridtrain.data import write_synthetic_shapes

    write_synthetic_shapes(d / "shapes", 2, seed=0, text_only=0.0)
    data = d / "shapes" / "data.jsonl"
    _write(data, data.read_text(encoding="utf-8"), bom)
    return data, {"tokenizer": toks["vision"], "patch_size": 4, "min_patches": 16,
                  "max_patches": 64}


SAMPLES = {"text": _text, "json": _json, "jsonl": _jsonl_sample, "recipe": _recipe,
           "model config": _model_config, "tokenizer": _tokenizer,
           "chat template": _chat_template, "prompts": _prompts, "squad": _squad,
           "chat": _chat_data, "preference": _preference, "vision chat": _vision_chat}


def _digest(value):
    """What a reader returned, as comparable plain data."""
    if hasattr(value, "get_vocab"):  # a tokenizer
        return value.get_vocab(), value.chat_template, value("Où ? é").input_ids
    if isinstance(value, (types.GeneratorType, map, filter)):
        return [_digest(v) for v in value]
    if hasattr(value, "to_dict"):  # a recipe, a model config
        return value.to_dict()
    if hasattr(value, "__getitem__") and hasattr(value, "__len__") and not isinstance(
            value, (str, bytes, dict, list, tuple)):  # a dataset
        return [repr(value[i]) for i in range(len(value))]
    return value


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    from hybridtrain.data import build_bpe_tokenizer, shapes_texts, synthetic_texts

    root = tmp_path_factory.mktemp("tok")
    return {
        "text": build_bpe_tokenizer(synthetic_texts(40, seed=0) + [CTX] * 3, root / "text",
                                    vocab_size=300),
        "vision": build_bpe_tokenizer(shapes_texts()[:50], root / "vision", vocab_size=270,
                                      extra_special_tokens=["<image>"]),
    }


def _name(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


@pytest.mark.parametrize("reader", sorted(TEXT_READERS, key=_name), ids=_name)
def test_every_reader_reads_utf8_with_a_byte_order_mark(reader, toks, tmp_path, monkeypatch):
    kind, arg = TEXT_READERS[reader]
    assert kind in SAMPLES, f"{_name(reader)} reads {kind!r} files: add a sample of them here"
    monkeypatch.setenv("HYBRIDTRAIN_DATA_CACHE", str(tmp_path / "cache"))
    params = inspect.signature(reader).parameters
    assert arg in params, f"{_name(reader)} has no parameter {arg!r}"
    got = {}
    for bom in (False, True):  # the same path, so that what a reader returns may name it
        folder = tmp_path / "input"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        path, kwargs = SAMPLES[kind](folder, bom, toks)
        if bom:
            assert path.is_dir() or path.read_bytes().startswith(BOM)
        kwargs = {k: v for k, v in kwargs.items() if k in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values())}
        got[bom] = _digest(reader(**{arg: str(path)}, **kwargs))
    assert got[True] == got[False]


def test_a_mark_inside_a_file_is_still_text(tmp_path):
    """Only a mark that starts the file is dropped: one later in it is the character U+FEFF."""
    from hybridtrain.fileio import read_jsonl

    path = tmp_path / "a.jsonl"
    path.write_bytes(BOM + b'{"a": 1}\n' + b'{"b": "\xef\xbb\xbfx"}\n')
    assert read_jsonl(path) == [{"a": 1}, {"b": "\ufeffx"}]
