"""Vision-language data: LLaVA and OpenAI records, patch budgets, placeholder expansion,
assistant-only labels, text-only samples, packing and collation."""

import json

import pytest
import torch

from hybridtrain.data import (
    IGNORE_INDEX,
    build_bpe_tokenizer,
    build_collator,
    build_vision_chat_dataset,
    pack_dataset,
    shapes_texts,
    write_synthetic_shapes,
)
from hybridtrain.data.images import load_patches, patch_grid
from hybridtrain.data.io import ChatFormatError, DataError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_bpe_tokenizer(shapes_texts(), tmp_path_factory.mktemp("tok"), vocab_size=300,
                               extra_special_tokens=["<image>"])


KW = dict(patch_size=4, min_patches=16, max_patches=64)


@pytest.mark.parametrize("w,h", [(32, 32), (48, 32), (32, 48), (200, 20), (4, 4), (64, 64)])
def test_patch_grid_budget_and_aspect(w, h):
    r, c = patch_grid(w, h, 4, 16, 64)
    assert 16 <= r * c <= 64 and r % 2 == 0 and c % 2 == 0
    if w != h and max(w, h) / min(w, h) < 4:
        assert (c > r) == (w > h)


def test_llava_and_openai_records(tmp_path, tok):
    p1 = write_synthetic_shapes(tmp_path / "a", 30, seed=0, text_only=0.3)
    p2 = write_synthetic_shapes(tmp_path / "b", 30, seed=0, text_only=0.3, style="openai")
    a, b = build_vision_chat_dataset(p1, tok, **KW), build_vision_chat_dataset(p2, tok, **KW)
    img = tok.convert_tokens_to_ids("<image>")
    n_text = 0
    for ds in (a, b):
        for i in range(len(ds)):
            ex = ds[i]
            grid = ex["image_grid"]
            n_img = int((ex["input_ids"] == img).sum())
            assert n_img == int((grid[:, 0] * grid[:, 1]).sum()) // 4  # one per embedding
            assert ex["pixel_values"].shape == (int((grid[:, 0] * grid[:, 1]).sum()), 48)
            assert (ex["labels"][ex["input_ids"] == img] == IGNORE_INDEX).all()
            n_text += grid.shape[0] == 0
            # assistant-only: the supervised tokens decode to the answer and end-of-turn
            sup = ex["labels"][ex["labels"] != IGNORE_INDEX]
            assert tok.decode(sup).endswith("<|im_end|>")
    assert n_text > 0
    # the same content in both record styles tokenizes the same
    assert [e[0] for e in a.examples] == [e[0] for e in b.examples]


def test_pixels_are_normalised_patches(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "r.png")
    x = load_patches(tmp_path / "r.png", (2, 2), 4, mean=(0.5,) * 3, std=(0.5,) * 3)
    assert x.shape == (4, 48)
    assert torch.allclose(x[:, :16], torch.ones(4, 16)) and torch.allclose(x[:, 16:], -torch.ones(4, 32))


def test_errors_name_the_record(tmp_path, tok):
    (tmp_path / "d.jsonl").write_text(json.dumps(
        {"image": ["x.png", "y.png"], "conversations": [
            {"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "red"}]}) + "\n")
    with pytest.raises(ChatFormatError, match="line 1.*1 <image> placeholders but 2 images"):
        build_vision_chat_dataset(tmp_path / "d.jsonl", tok, **KW)
    (tmp_path / "e.jsonl").write_text(json.dumps(
        {"image": "missing.png", "conversations": [
            {"from": "human", "value": "hi"}, {"from": "gpt", "value": "red"}]}) + "\n")
    with pytest.raises(DataError, match="missing.png does not exist"):
        build_vision_chat_dataset(tmp_path / "e.jsonl", tok, **KW)
    with pytest.raises(ValueError, match="not one token"):
        build_vision_chat_dataset(tmp_path / "e.jsonl", tok, image_token="<img>", **KW)


def test_packing_and_collation_keep_image_order(tmp_path, tok):
    ds = build_vision_chat_dataset(write_synthetic_shapes(tmp_path, 40, seed=2), tok, **KW)
    packed = pack_dataset(ds, 160)
    assert len(packed) < len(ds)
    batch = build_collator(packed)([packed[0], packed[1]])
    img = tok.convert_tokens_to_ids("<image>")
    grid = batch["image_grid"]
    assert int((batch["input_ids"] == img).sum()) == int((grid[:, 0] * grid[:, 1]).sum()) // 4
    docs = packed.bins[0] + packed.bins[1]
    ref = torch.cat([ds[i]["pixel_values"] for i in docs])
    assert torch.equal(batch["pixel_values"], ref)
    # rows of the padding collator too
    b2 = build_collator(ds)([ds[0], ds[1]])
    assert torch.equal(b2["pixel_values"], torch.cat([ds[0]["pixel_values"], ds[1]["pixel_values"]]))


def test_image_start_and_end_wrap_each_image_run(tmp_path):
    """``image_start`` / ``image_end``: each image's placeholder run sits between them (a
    model's own markers, e.g. ``<img>`` ... ``</img>``), without labels."""
    tok = build_bpe_tokenizer(shapes_texts(), tmp_path / "tok", vocab_size=300,
                              extra_special_tokens=["<image>", "<img>", "</img>"])
    path = write_synthetic_shapes(tmp_path / "d", 8, seed=0, style="openai")
    ds = build_vision_chat_dataset(path, tok, image_start="<img>", image_end="</img>", **KW)
    img, start, end = tok.convert_tokens_to_ids(["<image>", "<img>", "</img>"])
    ex = ds[0]
    ids = ex["input_ids"].tolist()
    n = int(ex["image_grid"].prod(-1).sum()) // 4
    i = ids.index(start)
    assert ids[i + 1:i + 1 + n] == [img] * n and ids[i + 1 + n] == end
    assert (ex["labels"][i:i + n + 2] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="image_start"):
        build_vision_chat_dataset(path, tok, image_start="<nope>", **KW)
