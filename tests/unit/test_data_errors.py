"""Bad input: each case raises (or reports) its own specific message."""

from __future__ import annotations

import json

import pytest
from tests.helpers.data import label_tokens

from hybridtrain.data import (
    AnswerMismatchError,
    DataError,
    EmptyDatasetError,
    MalformedJSONError,
    MissingFieldError,
    build_chat_dataset,
    build_squad_dataset,
)

CTX = "The Normans gave their name to Normandy, a region in France, in the 10th century."


def rec(i, **kw):
    r = {"id": f"q{i}", "context": CTX, "question": "Where is Normandy?",
         "answers": {"text": ["France"], "answer_start": [CTX.index("France")]}}
    r.update(kw)
    return r


def jsonl(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return path


def test_malformed_jsonl_line_names_file_and_line(tok, tmp_path):
    p = jsonl(tmp_path / "bad.jsonl", [rec(0), rec(1), '{"id": "q2", "context": "x",', rec(3)])
    with pytest.raises(MalformedJSONError, match=r"bad\.jsonl: line 3: malformed JSON") as e:
        build_squad_dataset(p, tok, cache_dir=False)
    assert e.value.line == 3 and e.value.path.endswith("bad.jsonl")
    assert isinstance(e.value, ValueError)
    p = jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "[1, 2]"])
    with pytest.raises(MalformedJSONError, match=r"chat\.jsonl: line 2: .*expected a JSON object"):
        build_chat_dataset(p, tok, cache_dir=False)


def test_malformed_json_file_names_line(tok, tmp_path):
    p = tmp_path / "squad.json"
    p.write_text('{"version": "1.1",\n "data": [\n  {"title": "x"\n   "paragraphs": []}\n ]\n}\n')
    with pytest.raises(MalformedJSONError, match=r"squad\.json: line 4: malformed JSON"):
        build_squad_dataset(p, tok, cache_dir=False)


def test_missing_field_names_field_and_record(tok, tmp_path):
    bad = rec(1)
    del bad["question"]
    p = jsonl(tmp_path / "m.jsonl", [rec(0), bad])
    with pytest.raises(MissingFieldError,
                       match=r"m\.jsonl line 2 \(id 'q1'\): missing required field 'question'"):
        build_squad_dataset(p, tok, cache_dir=False)
    # nested SQuAD: the path to the record and its id
    doc = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": CTX, "qas": [
        {"id": "a", "question": "Where?", "answers": [{"text": "France", "answer_start": 59}]},
        {"id": "b", "question": "Where?"},
    ]}]}]}
    p = tmp_path / "n.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(MissingFieldError, match=r"n\.json data\[0\]\.paragraphs\[0\]\.qas\[1\] "
                                                r"\(id 'b'\): missing required field 'answers'"):
        build_squad_dataset(p, tok, cache_dir=False)
    del doc["data"][0]["paragraphs"][0]["context"]
    p.write_text(json.dumps(doc))
    with pytest.raises(MissingFieldError, match=r"paragraphs\[0\]: missing required field 'context'"):
        build_squad_dataset(p, tok, cache_dir=False)


def test_wrong_answer_start_is_repaired(tok, tmp_path):
    good = CTX.index("France")
    p = jsonl(tmp_path / "r.jsonl", [
        rec(0, answers={"text": ["France"], "answer_start": [good + 7]}),
        rec(1, answers={"text": ["France"], "answer_start": [good]}),
        rec(2, answers=[{"text": " France", "answer_start": good - 1}]),  # SQuAD list form
    ])
    ds = build_squad_dataset(p, tok, seq_length=28, padding="max_length", cache_dir=False)
    assert ds.stats["repaired"] == 1 and len(ds) == 3
    for i in range(3):
        assert tok.decode(label_tokens(ds[i])) == " France" + tok.eos_token
        # the shortened context still holds the answer, since answer_start was repaired
        prompt = tok.decode(ds[i]["input_ids"][ds[i]["attention_mask"] == 1])
        assert "France" in prompt.split("\nQuestion:")[0]


def test_answer_not_in_context_is_reported(tok, tmp_path):
    p = jsonl(tmp_path / "x.jsonl", [rec(0), rec(1, answers={"text": ["Spain"], "answer_start": [3]})])
    with pytest.raises(AnswerMismatchError,
                       match=r"x\.jsonl line 2 \(id 'q1'\): answer 'Spain' \(answer_start=3\) "
                             r"is not in the context"):
        build_squad_dataset(p, tok, cache_dir=False)
    ds = build_squad_dataset(p, tok, on_bad_record="skip", cache_dir=False)
    assert len(ds) == 1 and ds.stats["dropped"] == {"answer_not_in_context": 1}


def test_empty_dataset_says_why(tok, tmp_path):
    p = jsonl(tmp_path / "u.jsonl", [
        rec(i, answers={"text": [], "answer_start": []}) for i in range(3)
    ] + [rec(3, is_impossible=True, answers=[])])
    with pytest.raises(EmptyDatasetError,
                       match=r"no examples left after filtering: 4 records read, "
                             r"dropped: 4 unanswerable") as e:
        build_squad_dataset(p, tok, cache_dir=False)
    assert e.value.dropped == {"unanswerable": 4}
    assert "unanswerable_answer" in str(e.value)
    p = jsonl(tmp_path / "l.jsonl", [rec(i) for i in range(5)])
    with pytest.raises(EmptyDatasetError, match=r"5 records read, dropped: 5 too_long.*seq_length"):
        build_squad_dataset(p, tok, seq_length=8, cache_dir=False)
    p = jsonl(tmp_path / "mix.jsonl", [rec(0, answers={"text": ["Spain"], "answer_start": [0]}),
                                        rec(1, answers={"text": [], "answer_start": []})])
    with pytest.raises(EmptyDatasetError,
                       match="1 answer_not_in_context, 1 unanswerable"):
        build_squad_dataset(p, tok, on_bad_record="skip", cache_dir=False)


def test_other_user_errors_are_value_errors(tok, tmp_path):
    p = jsonl(tmp_path / "ok.jsonl", [rec(0)])
    for kw, msg in (
        ({"padding": "max_length"}, "needs seq_length"),
        ({"padding": "longest", "seq_length": 32}, "padding must be"),
        ({"completion_template": "no answer"}, r"\{answer\}"),
        ({"on_bad_record": "ignore"}, "on_bad_record"),
    ):
        with pytest.raises(ValueError, match=msg):
            build_squad_dataset(p, tok, cache_dir=False, **kw)
    with pytest.raises(DataError, match="no such data file"):
        build_squad_dataset(tmp_path / "missing.jsonl", tok, cache_dir=False)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="unknown data file type"):
        build_squad_dataset(tmp_path / "notes.txt", tok, cache_dir=False)
    with pytest.raises(DataError, match="split 'validation'"):
        build_squad_dataset(tmp_path, tok, split="validation", cache_dir=False)
