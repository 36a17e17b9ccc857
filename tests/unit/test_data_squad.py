"""SQuAD: answer-preserving fixed-length truncation, formats, unanswerable, cache."""

from __future__ import annotations

import json
import logging

import pytest
from tests.helpers.data import label_tokens, require_squad_subset, squad_subset_tokenizer

from hybridtrain.data import (
    build_squad_dataset,
    read_squad,
    write_synthetic_squad,
)
from hybridtrain.data import squad as squad_mod


@pytest.fixture(scope="module")
def squad_tok(tmp_path_factory):
    """A BPE trained on the real subset (its tests measure how much of it fits a length)."""
    return squad_subset_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def subset_answers():
    """id -> (first answer text, context) of the answerable questions of the real subset."""
    path = require_squad_subset()
    doc = json.loads(path.read_text())
    out = {}
    for art in doc["data"]:
        for par in art["paragraphs"]:
            for qa in par["qas"]:
                if qa["answers"] and not qa.get("is_impossible"):
                    out[qa["id"]] = (qa["answers"][0]["text"].strip(), par["context"])
    return out


def _check_fixed(ds, tok, L, answers):
    eos = tok.eos_token
    for i in range(len(ds)):
        ex = ds[i]
        assert ex["input_ids"].shape == (L,) and ex["labels"].shape == (L,)
        labs = label_tokens(ex)
        assert len(labs) > 0
        answer, _ = answers[ds.record_id(i)]
        # The label tokens are exactly the completion: " " + answer + eos.
        assert tok.decode(labs) == " " + answer + eos
        # Labels are shifted: labels[t] is the token at t+1; nothing is supervised on padding.
        ids, labels, mask = ex["input_ids"], ex["labels"], ex["attention_mask"]
        n = int(mask.sum())
        assert (labels[n - 1 :] == -100).all()
        sup = (labels[:-1] != -100).nonzero().flatten()
        assert (labels[sup] == ids[sup + 1]).all()
        # The answer is still in the (possibly shortened) context of the prompt.
        prompt = tok.decode(ids[: int(sup[0]) + 1])
        ctx = prompt.split("Context: ", 1)[1].split("\nQuestion: ", 1)[0]
        assert answer in ctx


@pytest.mark.parametrize("L, max_dropped", [(256, 5), (96, 60)])
def test_real_subset_fixed_length(squad_tok, subset_answers, caplog, L, max_dropped):
    tok = squad_tok
    path = require_squad_subset()
    with caplog.at_level(logging.WARNING, logger="hybridtrain.data"):
        ds = build_squad_dataset(
            path, tok, seq_length=L, padding="max_length", truncation=True, cache_dir=False
        )
    st = ds.stats
    dropped = sum(st["dropped"].values())
    assert st["read"] == 1407
    assert st["skipped"] == {"unanswerable": 1407 - len(subset_answers)}
    assert st["kept"] == len(ds) == len(subset_answers) - dropped
    assert dropped <= max_dropped
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == (1 if dropped else 0)
    if dropped:
        assert f"dropped {dropped} of" in warnings[0].getMessage()
    _check_fixed(ds, tok, L, subset_answers)
    if L == 96:  # long contexts really were shortened (about half the rows), and kept the answer
        assert (ds.lengths == 96).sum() > len(ds) // 3


def test_real_subset_too_short_drops_with_one_warning(squad_tok, subset_answers, caplog):
    tok = squad_tok
    path = require_squad_subset()
    with caplog.at_level(logging.WARNING, logger="hybridtrain.data"):
        ds = build_squad_dataset(path, tok, seq_length=40, padding="max_length", cache_dir=False)
    dropped = ds.stats["dropped"]["too_long"]
    assert dropped > 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"dropped {dropped} of 1407" in warnings[0] and "too_long" in warnings[0]
    _check_fixed(ds, tok, 40, subset_answers)


def test_window_is_maximal_and_centred(tok, tmp_path):
    ctx = " ".join(f"w{i}" for i in range(300)) + " ANSWER " + " ".join(f"v{i}" for i in range(300))
    rec = {"id": "a", "context": ctx, "question": "Where?",
           "answers": [{"text": "ANSWER", "answer_start": ctx.index("ANSWER")}]}
    doc = {"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": ctx, "qas": [{k: rec[k] for k in ("id", "question", "answers")}]}]}]}
    p = tmp_path / "s.json"
    p.write_text(json.dumps(doc))
    for L in (64, 128):
        ds = build_squad_dataset(p, tok, seq_length=L, cache_dir=False)
        ex = ds[0]
        assert len(ex["input_ids"]) <= L
        assert len(ex["input_ids"]) >= L - 6  # about one more word would not have fitted
        text = tok.decode(ex["input_ids"])
        window = text.split("Context: ", 1)[1].split("\nQuestion:", 1)[0].split()
        k = window.index("ANSWER")
        assert abs(k - (len(window) - 1 - k)) <= 2  # centred on the answer


def test_variable_length_and_no_truncation(tok, tmp_path):
    p = write_synthetic_squad(tmp_path / "syn.json", 40, seed=3)
    ds = build_squad_dataset(p, tok, cache_dir=False)  # no seq_length: nothing cut, no padding
    assert ds.stats["kept"] == 40 and len(set(ds.lengths.tolist())) > 1
    for i in range(len(ds)):
        assert len(ds[i]["input_ids"]) == ds.lengths[i]
    short = int(ds.lengths.min())
    ds2 = build_squad_dataset(p, tok, seq_length=short, truncation=False, cache_dir=False)
    assert ds2.stats["dropped"]["too_long_no_truncation"] == int((ds.lengths > short).sum())
    assert (ds2.lengths <= short).all()


def test_unanswerable_answer_string(squad_tok, subset_answers):
    tok = squad_tok
    path = require_squad_subset()
    ds = build_squad_dataset(path, tok, seq_length=96, padding="max_length",
                             unanswerable_answer="unanswerable", cache_dir=False)
    assert ds.stats["kept"] == 1407 and not ds.stats["skipped"]
    texts = {tok.decode(label_tokens(ds[i])) for i in range(len(ds))
             if ds.record_id(i) not in subset_answers}
    assert texts == {" unanswerable" + tok.eos_token}


def test_flat_jsonl_parquet_and_datasets_object_agree(tok, tmp_path):
    import datasets

    p = write_synthetic_squad(tmp_path / "syn.json", 30, seed=5)
    rd = read_squad(p)["columns"]
    flat = [
        {"id": rd["id"][i], "title": rd["title"][i], "context": rd["context"][i],
         "question": rd["question"][i],
         "answers": {"text": [rd["answer"][i]], "answer_start": [rd["answer_start"][i]]}}
        for i in range(len(rd["id"]))
    ]
    jl = tmp_path / "train.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in flat) + "\n")
    pq = tmp_path / "flat.parquet"
    hf = datasets.Dataset.from_list(flat)
    hf.to_parquet(str(pq))
    ref = build_squad_dataset(p, tok, seq_length=64, cache_dir=False)
    for src, kw in ((jl, {}), (pq, {}), (hf, {}), (tmp_path, {"split": "train"})):
        ds = build_squad_dataset(src, tok, seq_length=64, cache_dir=False, **kw)
        assert len(ds) == len(ref)
        for i in range(len(ds)):
            assert ds[i]["input_ids"].tolist() == ref[i]["input_ids"].tolist()
            assert ds[i]["labels"].tolist() == ref[i]["labels"].tolist()


def test_custom_templates(tok, tmp_path):
    p = write_synthetic_squad(tmp_path / "syn.json", 10, seed=1)
    ds = build_squad_dataset(
        p, tok, cache_dir=False,
        prompt_template="Q: {question}\nC: {context}\nA:",
        completion_template=" The answer is {answer}.",
    )
    rd = read_squad(p)["columns"]
    for i in range(len(ds)):
        text = tok.decode(ds[i]["input_ids"])
        assert text.startswith("Q: " + rd["question"][i])
        assert tok.decode(label_tokens(ds[i])) == f" The answer is {rd['answer'][i]}.{tok.eos_token}"
    with pytest.raises(ValueError, match="question"):
        build_squad_dataset(p, tok, prompt_template="{context}", cache_dir=False)


def test_cache_reuses_and_invalidates(tok, tmp_path, monkeypatch):
    p = write_synthetic_squad(tmp_path / "syn.json", 50, seed=2)
    cache = tmp_path / "cache"
    a = build_squad_dataset(p, tok, seq_length=64, cache_dir=cache)
    assert a.cache_path is not None and a.cache_path.parent == cache

    def boom(*a, **k):
        raise AssertionError("re-read although cached")

    monkeypatch.setattr(squad_mod, "read_squad", boom)
    b = build_squad_dataset(p, tok, seq_length=64, cache_dir=cache)  # memory-mapped reload
    assert b.cache_path == a.cache_path and b.stats == a.stats
    assert [b[i]["input_ids"].tolist() for i in range(len(b))] == \
           [a[i]["input_ids"].tolist() for i in range(len(a))]
    # any option, the tokenizer or the source file changing must re-tokenise
    for kw in ({"seq_length": 48}, {"prompt_template": "C: {context} Q: {question} A:"},
               {"unanswerable_answer": "none"}, {"truncation": False}):
        with pytest.raises(AssertionError, match="re-read"):
            build_squad_dataset(p, tok, **{"seq_length": 64, "cache_dir": cache, **kw})
    monkeypatch.undo()
    write_synthetic_squad(p, 50, seed=9)
    c = build_squad_dataset(p, tok, seq_length=64, cache_dir=cache)
    assert c.cache_path != a.cache_path


def test_num_proc_gives_identical_examples(tok, tmp_path):
    p = write_synthetic_squad(tmp_path / "syn.json", 2500, seed=4)
    one = build_squad_dataset(p, tok, seq_length=48, cache_dir=tmp_path / "c1", num_proc=1)
    two = build_squad_dataset(p, tok, seq_length=48, cache_dir=tmp_path / "c2", num_proc=2)
    assert len(one) == len(two) == 2500
    assert one.hf_dataset["input_ids"][:] == two.hf_dataset["input_ids"][:]
    assert one.hf_dataset["labels"][:] == two.hf_dataset["labels"][:]


def test_dataset_pickles_for_dataloader_workers(tok, tmp_path):
    import pickle

    p = write_synthetic_squad(tmp_path / "syn.json", 20, seed=4)
    ds = build_squad_dataset(p, tok, seq_length=64, padding="max_length", cache_dir=tmp_path / "c")
    again = pickle.loads(pickle.dumps(ds))
    assert again[3]["input_ids"].tolist() == ds[3]["input_ids"].tolist()


def test_builders_have_explicit_signatures_for_yaml():
    import inspect

    from hybridtrain.data import ChatDataset, SquadDataset, build_chat_dataset

    for fn in (build_squad_dataset, SquadDataset, build_chat_dataset, ChatDataset):
        params = inspect.signature(fn).parameters
        assert "seq_length" in params and "cache_dir" in params and "num_proc" in params
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
