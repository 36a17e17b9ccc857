"""Packing and collation: every token and label exactly once, no label across documents."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from tests.helpers.data import bpe_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridtrain.data import (
    PackedCollator,
    PaddingCollator,
    build_collator,
    build_squad_dataset,
    first_fit_decreasing,
    pack_dataset,
    pack_sequences,
    write_synthetic_squad,
)

PAD = 0


def make_doc(rng: random.Random, n: int, doc_no: int):
    """A document with shifted labels: labels[t] = ids[t+1] on a random supervised suffix."""
    ids = [1000 * (doc_no + 1) + t for t in range(n)]  # unique ids name their doc and position
    start = rng.randint(1, n) if n > 1 else 1
    labels = [ids[t + 1] if t + 1 >= start else -100 for t in range(n - 1)] + [-100]
    return ids, labels


def check_rows(rows, docs, pack_size, multiple=1):
    seen = []
    total_labels = 0
    for row in rows:
        ids, labels, pos = row["input_ids"], row["labels"], row["position_ids"]
        cu = row["cu_seqlens"]
        assert cu.dtype == torch.int32 and ids.shape == labels.shape == pos.shape == (pack_size,)
        assert int(cu[0]) == 0 and int(cu[-1]) == pack_size
        seg = (cu[1:] - cu[:-1]).tolist()
        assert all(s > 0 for s in seg)
        # position_ids restart at 0 exactly at the segment starts and count up inside a segment
        starts = set(cu[:-1].tolist())
        assert {t for t in range(pack_size) if int(pos[t]) == 0} == starts
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert pos[a:b].tolist() == list(range(b - a))
        # documents come back intact, in their segments, padded only at their end
        for k, d in enumerate(row["doc_ids"]):
            a, b = int(cu[k]), int(cu[k + 1])
            d_ids, d_labels = docs[d]
            n = len(d_ids)
            assert b - a == -(-n // multiple) * multiple
            assert ids[a : a + n].tolist() == d_ids and labels[a : a + n].tolist() == d_labels
            assert (ids[a + n : b] == PAD).all() and (labels[a + n : b] == -100).all()
            assert int(row["attention_mask"][a:b].sum()) == n
            seen.append(d)
        # the rest of the row is one padding segment
        used = int(cu[len(row["doc_ids"])])
        if used < pack_size:
            assert len(seg) == len(row["doc_ids"]) + 1
            assert (ids[used:] == PAD).all() and (labels[used:] == -100).all()
        # no label crosses a document boundary: a label is the next token of the same segment
        seg_of = torch.repeat_interleave(torch.arange(len(seg)), torch.tensor(seg))
        for t in (labels != -100).nonzero().flatten().tolist():
            assert t + 1 < pack_size and seg_of[t] == seg_of[t + 1] and labels[t] == ids[t + 1]
        total_labels += int((labels != -100).sum())
        assert row["num_label_tokens"] == int((labels != -100).sum())
        assert row["num_tokens"] == sum(len(docs[d][0]) for d in row["doc_ids"])
    assert sorted(seen) == list(range(len(docs)))  # every document exactly once
    assert total_labels == sum(sum(1 for x in l if x != -100) for _, l in docs)


def test_pack_small_example():
    rng = random.Random(0)
    docs = [make_doc(rng, n, i) for i, n in enumerate([5, 3, 7, 2, 8, 1])]
    rows = pack_sequences(docs, pack_size=10, pad_token_id=PAD)
    check_rows(rows, docs, 10)
    assert [r["doc_ids"] for r in rows] == [[4, 3], [2, 1], [0, 5]]  # first-fit-decreasing


def test_pad_each_document_to_multiple():
    rng = random.Random(1)
    docs = [make_doc(rng, n, i) for i, n in enumerate([5, 3, 7, 2, 8, 1, 4])]
    rows = pack_sequences(docs, pack_size=16, pad_token_id=PAD, pad_to_multiple_of=4)
    check_rows(rows, docs, 16, multiple=4)
    for r in rows:
        assert all(int(x) % 4 == 0 for x in r["cu_seqlens"])
    with pytest.raises(ValueError, match="multiple"):
        pack_sequences(docs, pack_size=18, pad_token_id=PAD, pad_to_multiple_of=4)


def test_document_longer_than_pack_size():
    docs = [make_doc(random.Random(0), 9, 0)]
    with pytest.raises(ValueError, match="document 0 has 9 tokens, more than packing.pack_size=8"):
        pack_sequences(docs, pack_size=8, pad_token_id=PAD)


def test_unshifted_labels_are_rejected():
    with pytest.raises(ValueError, match="shifted"):
        pack_sequences([([1, 2, 3], [2, 3, 4])], pack_size=8, pad_token_id=PAD)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    pack_size=st.sampled_from([40, 48, 64, 100]),
    multiple=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_packing_property(lengths, pack_size, multiple, seed):
    if pack_size % multiple:
        return
    rng = random.Random(seed)
    docs = [make_doc(rng, n, i) for i, n in enumerate(lengths)]
    rows = pack_sequences(docs, pack_size, PAD, pad_to_multiple_of=multiple)
    check_rows(rows, docs, pack_size, multiple)
    # first fit: no two rows are both at most half full
    used = sorted(int(r["cu_seqlens"][len(r["doc_ids"])]) for r in rows)
    assert len(used) < 2 or used[1] > pack_size / 2
    # and the collated batch's flattened cu_seqlens agree with its position_ids
    batch = PackedCollator()(rows)
    flat_pos = batch["position_ids"].flatten()
    cu = batch["cu_seqlens"]
    assert cu.dtype == torch.int32 and int(cu[-1]) == len(rows) * pack_size
    assert set((flat_pos == 0).nonzero().flatten().tolist()) == set(cu[:-1].tolist())
    assert batch["max_seqlen"] == int((cu[1:] - cu[:-1]).max())
    assert int(batch["num_tokens"]) == sum(lengths)
    assert int(batch["num_label_tokens"]) == sum(
        sum(1 for x in l if x != -100) for _, l in docs)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    pack_size=st.sampled_from([40, 64]),
    multiple=st.sampled_from([1, 4]),
    rows_per_batch=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_padding_free_batch_is_the_documents_of_the_padded_one(lengths, pack_size, multiple,
                                                              rows_per_batch, seed):
    """A padding-free batch holds exactly the padded batch's document segments, in order (each
    document's own padding to the multiple kept), and nothing of the rows' trailing padding."""
    rng = random.Random(seed)
    docs = [make_doc(rng, n, i) for i, n in enumerate(lengths)]
    rows = pack_sequences(docs, pack_size, PAD, pad_to_multiple_of=multiple)
    for first in range(0, len(rows), rows_per_batch):
        group = rows[first:first + rows_per_batch]
        padded, flat = PackedCollator()(group), PackedCollator(padding_free=True)(group)
        cu = padded["cu_seqlens"].tolist()
        ids, mask = padded["input_ids"].flatten(), padded["attention_mask"].flatten()
        segments = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if mask[a] == 1]  # the documents
        assert len(segments) == sum(len(r["doc_ids"]) for r in group)
        T = sum(b - a for a, b in segments)
        assert flat["cu_seqlens"].dtype == torch.int32
        assert flat["cu_seqlens"].tolist() == [0, *itertools.accumulate(b - a for a, b in segments)]
        for key in ("input_ids", "labels", "position_ids", "attention_mask"):
            assert flat[key].shape == (1, T)
            whole = padded[key].flatten()
            assert flat[key][0].tolist() == [v for a, b in segments for v in whole[a:b].tolist()], key
        for key in ("num_tokens", "num_label_tokens"):
            assert int(flat[key]) == int(padded[key])
        assert flat["max_seqlen"] == max(b - a for a, b in segments)
        assert (ids[[t for a, b in segments for t in range(a, b)]] != PAD).sum() == int(flat["num_tokens"])


def test_padding_free_needs_packed_text_rows(squad_ds):
    with pytest.raises(ValueError, match="packing.padding_free: false"):
        build_collator(squad_ds, padding_free=True)


@given(sizes=st.lists(st.integers(1, 50), max_size=60), cap=st.integers(50, 120))
@settings(max_examples=100, deadline=None)
def test_first_fit_decreasing_matches_naive(sizes, cap):
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins, free = [], []
    for i in order:
        for b, f in enumerate(free):
            if f >= sizes[i]:
                bins[b].append(i)
                free[b] -= sizes[i]
                break
        else:
            bins.append([i])
            free.append(cap - sizes[i])
    assert first_fit_decreasing(sizes, cap) == bins


@pytest.fixture(scope="module")
def squad_ds(tmp_path_factory):
    tok = bpe_tokenizer(tmp_path_factory)
    p = write_synthetic_squad(tmp_path_factory.mktemp("syn") / "s.json", 200, seed=7)
    return build_squad_dataset(p, tok, seq_length=64, padding="max_length", cache_dir=False)


def test_pack_tokenized_dataset_and_collate(squad_ds):
    packed = pack_dataset(squad_ds, pack_size=256, pad_to_multiple_of=8)
    docs = [squad_ds.get_unpadded(i) for i in range(len(squad_ds))]
    rows = [packed[r] for r in range(len(packed))]
    check_rows(rows, docs, 256, multiple=8)
    assert len(packed) < len(squad_ds) / 3 and packed.utilization() > 0.7
    assert isinstance(build_collator(packed), PackedCollator)
    loader = torch.utils.data.DataLoader(packed, batch_size=4, collate_fn=build_collator(packed))
    n_lab = n_tok = 0
    for batch in loader:
        B, L = batch["input_ids"].shape
        assert int(batch["cu_seqlens"][-1]) == B * L
        n_lab += int(batch["num_label_tokens"])
        n_tok += int(batch["num_tokens"])
    assert n_lab == int(squad_ds.num_label_tokens.sum()) and n_tok == int(squad_ds.lengths.sum())


def test_padding_collator(squad_ds):
    exs = [squad_ds[i] for i in range(3)]
    var = [{k: v[: int(e["attention_mask"].sum())] for k, v in e.items()} for e in exs]
    batch = PaddingCollator(pad_token_id=squad_ds.pad_token_id, pad_to_multiple_of=16)(var)
    longest = max(len(v["input_ids"]) for v in var)
    B, L = batch["input_ids"].shape
    assert B == 3 and L % 16 == 0 and longest <= L < longest + 16
    for b, v in enumerate(var):
        n = len(v["input_ids"])
        assert batch["input_ids"][b, :n].tolist() == v["input_ids"].tolist()
        assert (batch["input_ids"][b, n:] == squad_ds.pad_token_id).all()
        assert (batch["labels"][b, n:] == -100).all() and (batch["attention_mask"][b, n:] == 0).all()
    assert int(batch["num_tokens"]) == sum(len(v["input_ids"]) for v in var)
    assert int(batch["num_label_tokens"]) == sum(int((v["labels"] != -100).sum()) for v in var)
    assert batch["position_ids"][0].tolist() == list(range(L))
    # already fixed-length examples stay at seq_length; padding is not counted as tokens
    fixed = build_collator(squad_ds)(exs)
    assert fixed["input_ids"].shape == (3, 64)
    assert int(fixed["num_tokens"]) == sum(int(e["attention_mask"].sum()) for e in exs)


def test_packed_batch_runs_documents_independently_in_the_model(squad_ds):
    """End to end: a packed, collated batch gives every document the logits it gets alone."""
    nemotron_h = pytest.importorskip("hybridtrain.models.nemotron_h")
    from hybridtrain.models.nemotron_h.tiny import tiny_config

    torch.manual_seed(0)
    vocab = 1 + max([squad_ds.pad_token_id] + [max(squad_ds.get_unpadded(i)[0])
                                                for i in range(len(squad_ds))])
    model = nemotron_h.NemotronHForCausalLM(tiny_config("mixed", vocab_size=vocab)).eval()
    packed = pack_dataset(squad_ds, pack_size=192, pad_to_multiple_of=8)
    batch = PackedCollator()([packed[0], packed[1]])
    with torch.no_grad():
        logits = model(batch["input_ids"], position_ids=batch["position_ids"],
                       cu_seqlens=batch["cu_seqlens"]).flatten(0, 1)
        ids = batch["input_ids"].flatten()
        cu = batch["cu_seqlens"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            alone = model(ids[a:b][None])[0]
            torch.testing.assert_close(logits[a:b], alone, rtol=1e-4, atol=1e-4)
