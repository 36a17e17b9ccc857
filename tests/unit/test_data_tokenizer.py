"""Tokenizer loading (offline) and the byte-level BPE builder."""

from __future__ import annotations

import json

import pytest

from hybridtrain.data import (
    CHATML_TEMPLATE,
    CHATML_TEMPLATE_NO_GENERATION,
    DataError,
    build_bpe_tokenizer,
    load_tokenizer,
    tokenizer_fingerprint,
)


def test_bpe_dir_is_a_standard_hf_tokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    again = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert again.eos_token == "<|endoftext|>" and again.pad_token == "<|pad|>"
    assert again.pad_token_id != again.eos_token_id
    for t in ("<|im_start|>", "<|im_end|>"):
        ids = again(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and again.convert_ids_to_tokens(ids[0]) == t
    assert again.chat_template == CHATML_TEMPLATE
    assert 2000 <= len(again) <= 3000


def test_bpe_round_trips_any_text(tok):
    text = "The Normans (Norman: Nourmands) — 1066, naïve café; 東京 🙂\n\tend"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok(text)["input_ids"] == ids  # no BOS/EOS added implicitly


def test_chat_template_generation_mask_works_in_this_transformers(tok):
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there."},
    ]
    out = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello there.<|im_end|>"


def test_load_tokenizer_is_offline_and_validates_path(tmp_path):
    with pytest.raises(DataError, match="not a local directory"):
        load_tokenizer("nvidia/some-model-on-the-hub")
    with pytest.raises(DataError, match="could not load a tokenizer"):
        load_tokenizer(tmp_path)  # an empty directory


def test_load_tokenizer_sets_pad_to_eos(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("pad_token")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id


def test_fingerprint_tracks_what_changes_ids(tok, tmp_path):
    fp = tokenizer_fingerprint(tok)
    assert fp == tokenizer_fingerprint(tok)
    tok("some text", truncation=True, max_length=3)  # call-time state must not matter
    assert fp == tokenizer_fingerprint(tok)
    other = build_bpe_tokenizer(["alpha beta gamma"] * 10, tmp_path / "o", vocab_size=300)
    assert tokenizer_fingerprint(other) != fp
    old = tok.chat_template
    try:
        tok.chat_template = CHATML_TEMPLATE_NO_GENERATION
        assert tokenizer_fingerprint(tok) != fp
    finally:
        tok.chat_template = old


def test_bpe_rejects_tiny_vocab(tmp_path):
    with pytest.raises(DataError, match="vocab_size"):
        build_bpe_tokenizer(["x"], tmp_path, vocab_size=100)


def test_encode_batch_matches_the_tokenizer_call(tok):
    from hybridtrain.data.tokenizer import encode_batch

    texts = ["Context: The Normans.\nQuestion: Who?\nAnswer:", " France", "<|im_start|>user\nhi"]
    for special in (True, False):
        assert encode_batch(tok, texts, special) == [
            list(x) for x in tok(texts, add_special_tokens=special)["input_ids"]
        ]
    tok(texts, truncation=True, max_length=2)  # leaves truncation state on the backend?
    assert encode_batch(tok, texts, True) == [list(x) for x in tok(texts)["input_ids"]]
