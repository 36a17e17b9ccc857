"""Vision-language SFT data: conversations with images, loss on assistant turns only.

::

    build_vision_chat_dataset(
        path,                  # .json / .jsonl (a file, glob or directory)
        tokenizer,             # tokenizer object or local directory; must hold image_token
        image_root=None,       # relative image paths are resolved here (default: the file's folder)
        image_token="<image>", # the placeholder token, one token of the tokenizer
        image_start=None, image_end=None,  # tokens around each image's run (e.g.
                               # "<img>", "</img>", as a model's processor writes them)
        patch_size=16, min_patches=4, max_patches=1024, merge=2,
        mean=DEFAULT_MEAN, std=DEFAULT_STD,
        seq_length=None,       # longer samples are dropped (an image is never cut)
        train_on="all", chat_template=None, chat_template_path=None,
        chat_template_kwargs=None, mask_strategy="auto", limit=None,
    ) -> VisionChatDataset

Records: LLaVA style ``{"image": "a.png" | ["a.png", ...], "conversations": [{"from": "human",
"value": "<image>\\nWhat is it?"}, {"from": "gpt", "value": "..."}]}`` (without ``<image>`` in
the text the images go before the first user turn), or OpenAI messages whose content parts
include ``{"type": "image", "image": path}`` or ``{"type": "image_url", "image_url": {"url":
path}}``. Records without images are text-only samples.

Every image is resized to a patch grid within [min_patches, max_patches] keeping its aspect
ratio (sides multiples of ``merge``), and its placeholder becomes ``rows * cols / merge^2``
copies of the image token, exactly the number of embeddings the model puts there; placeholders
never carry a label. An example holds ``input_ids``, shifted ``labels``, ``pixel_values``
[patches, 3 * p * p] and ``image_grid`` [images, 2]. ``pack(pack_size)`` packs several
examples per row; ``collator()`` batches examples or packed rows, concatenating the images of a
batch in the order of their placeholders.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridtrain.fileio import text_reader

from .batch import IGNORE_INDEX
from .chat import (
    added_token_strings,
    assistant_mask_generation,
    assistant_mask_placeholder,
    chat_renderer,
    empty_assistant_turns,
    normalize_conversation,
    resolve_template,
    _turn_selection,
)
from .chat_masks import end_of_turn
from .collate import PackedCollator, PaddingCollator
from .dataset import check_padding, shifted_labels
from .templates import template_origin
from .images import DEFAULT_MEAN, DEFAULT_STD, image_size, load_patches, patch_grid
from .io import (ChatFormatError, DataError, EmptyDatasetError, choose_split, iter_records,
                 record_name, resolve_data_files)
from .packing import _check, _round_up, build_row, first_fit_decreasing
from .tokenizer import as_tokenizer, template_has_generation_markers

logger = logging.getLogger(__name__)

IMAGE_PART_TYPES = ("image", "image_url")


def _image_path(part: Mapping, where: str) -> str:
    value = part.get("image") if part.get("type") == "image" else part.get("image_url")
    if isinstance(value, Mapping):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ChatFormatError(f"{where}: an image content part needs a path ('image' or "
                              "'image_url': {'url': ...})")
    if value.startswith("file://"):
        value = value[len("file://"):]
    if "://" in value or value.startswith("data:"):
        raise ChatFormatError(f"{where}: image {value[:60]!r} is not a local path (hybridtrain "
                              "reads images from local files only)")
    return value


def split_images(rec: Mapping, where: str, image_token: str) -> tuple[dict, list[str]]:
    """(the record with text-only content, its image paths in placeholder order)."""
    name = record_name(where, rec)
    if rec.get("messages") is not None:
        images, messages = [], []
        for k, m in enumerate(rec["messages"]):
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, list):
                parts = []
                for part in content:
                    if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                        images.append(_image_path(part, f"{name} messages[{k}]"))
                        parts.append(image_token)
                    else:
                        parts.append(part)
                m = {**m, "content": parts}
            messages.append(m)
        return {**rec, "messages": messages}, images
    images = rec.get("image", rec.get("images"))
    images = [] if images is None else [images] if isinstance(images, str) else list(images)
    convs = rec.get("conversations")
    if images and isinstance(convs, list):
        n = sum(str(c.get("value", "")).count(image_token) for c in convs if isinstance(c, Mapping))
        if n == 0:  # LLaVA convention: the images open the first user turn
            convs = [dict(c) for c in convs]
            first = next((c for c in convs if str(c.get("from", "")).lower() in ("human", "user")),
                         None)
            if first is None:
                raise ChatFormatError(f"{name}: images but no user turn to put them in")
            first["value"] = "".join(image_token + "\n" for _ in images) + str(first["value"])
            rec = {**rec, "conversations": convs}
    return rec, [str(p) for p in images]


def _one_token(tokenizer, token: str, key: str) -> int:
    """The id of ``token``, which must be one token of the tokenizer."""
    i = tokenizer.convert_tokens_to_ids(token)
    if (i is None or i == tokenizer.unk_token_id
            or tokenizer.encode(token, add_special_tokens=False) != [i]):
        raise ValueError(
            f"dataset.{key} {token!r} is not one token of the tokenizer; add it as a special "
            "token (build_bpe_tokenizer(..., extra_special_tokens=[...]) or "
            "tokenizer.add_special_tokens) and give the model its id")
    return i


class VisionChatDataset(torch.utils.data.Dataset):
    """Tokenized image-text conversations (arguments: see the module docstring)."""

    def __init__(self, path, tokenizer, image_root: str | None = None,
                 image_token: str = "<image>", image_start: str | None = None,
                 image_end: str | None = None, patch_size: int = 16, min_patches: int = 4,
                 max_patches: int = 1024, merge: int = 2, mean: Sequence[float] = DEFAULT_MEAN,
                 std: Sequence[float] = DEFAULT_STD, seq_length: int | None = None,
                 train_on: str = "all", chat_template: str | None = None,
                 chat_template_path: str | None = None,
                 chat_template_kwargs: Mapping | None = None, mask_strategy: str = "auto",
                 limit: int | None = None, trust_remote_code: bool = False,
                 split: str | None = None, default_split: str | None = None):
        split = choose_split(path, split, default_split)
        tokenizer = as_tokenizer(tokenizer, trust_remote_code)
        check_padding("none", seq_length)
        if train_on not in ("all", "last"):
            raise ValueError(f"train_on must be 'all' or 'last', got {train_on!r}")
        self.image_token_id = _one_token(tokenizer, image_token, "image_token")
        self.wrap = ([] if image_start is None else [_one_token(tokenizer, image_start,
                                                                "image_start")],
                     [] if image_end is None else [_one_token(tokenizer, image_end, "image_end")])
        template = resolve_template(tokenizer, chat_template, chat_template_path)
        strategy = mask_strategy
        if strategy == "auto":
            strategy = "generation" if template_has_generation_markers(template) else "placeholder"
        self.patch_size, self.merge = patch_size, merge
        self.mean, self.std = tuple(mean), tuple(std)
        self.pad_token_id = tokenizer.pad_token_id
        kwargs = dict(chat_template_kwargs or {})
        origin = template_origin(tokenizer, chat_template, chat_template_path)
        eot = None
        if strategy == "placeholder":
            eot = end_of_turn(chat_renderer(tokenizer, None, template, kwargs, origin=origin),
                              added_token_strings(tokenizer))
        self.examples: list[tuple[list[int], list[int], list[str], list[tuple[int, int]]]] = []
        self.ids: list[str] = []
        drops: Counter = Counter()
        read = 0
        for f in resolve_data_files(path, split):
            root = Path(image_root) if image_root else Path(f).parent
            for where, rec in iter_records(f):
                if limit is not None and read >= limit:
                    break
                read += 1
                rec, paths = split_images(rec, where, image_token)
                messages, tools = normalize_conversation(rec, where)
                name = record_name(where, rec)
                n_placeholders = sum((m.get("content") or "").count(image_token) for m in messages)
                if n_placeholders != len(paths):
                    raise ChatFormatError(f"{name}: {n_placeholders} {image_token} placeholders "
                                          f"but {len(paths)} images")
                skip = empty_assistant_turns(messages)
                if not any(_turn_selection(messages, set(skip), train_on)):
                    drops["empty_assistant_content"] += 1
                    continue
                args = (tokenizer, messages, tools, template, train_on, skip, kwargs, name, origin)
                ids, mask = (assistant_mask_generation(*args) if strategy == "generation"
                             else assistant_mask_placeholder(*args, eot=eot))
                paths = [p if os.path.isabs(p) else str(root / p) for p in paths]
                grids = [patch_grid(*image_size(p), patch_size, min_patches, max_patches, merge)
                         for p in paths]
                ids, mask = self._expand(ids, mask, grids, name)
                if seq_length is not None and len(ids) > seq_length:
                    drops["too_long_no_truncation"] += 1
                    continue
                labels = shifted_labels(ids, [bool(m) for m in mask])
                if all(x == IGNORE_INDEX for x in labels):
                    drops["no_supervised_tokens"] += 1
                    continue
                self.examples.append((ids, labels, paths, grids))
                self.ids.append(name)
        if drops:
            logger.warning("%s: dropped %s of %d records", path, dict(drops), read)
        if not self.examples:
            raise EmptyDatasetError(str(path), read, drops)
        self.lengths = [len(e[0]) for e in self.examples]

    def _expand(self, ids, mask, grids, name):
        """Each placeholder token -> one image token per embedding of its image (no label)."""
        out_ids, out_mask, k = [], [], 0
        for t, m in zip(ids, mask):
            if t == self.image_token_id:
                if k >= len(grids):
                    raise ChatFormatError(f"{name}: more image tokens than images after "
                                          "tokenization (does the text hold the image token?)")
                n = (grids[k][0] // self.merge) * (grids[k][1] // self.merge)
                start, end = self.wrap
                out_ids += start + [t] * n + end
                out_mask += [0] * (len(start) + n + len(end))
                k += 1
            else:
                out_ids.append(t)
                out_mask.append(m)
        if k != len(grids):
            raise ChatFormatError(f"{name}: {len(grids)} images but {k} image tokens after "
                                  "tokenization")
        return out_ids, out_mask

    def __len__(self) -> int:
        return len(self.examples)

    def record_id(self, i: int) -> str:
        return self.ids[i]

    def image_list(self, i: int) -> list[tuple[str, tuple[int, int]]]:
        """(path, patch grid) of each image of example ``i``, in placeholder order."""
        _, _, paths, grids = self.examples[i]
        return list(zip(paths, grids))

    def load_pixels(self, images: Sequence[tuple[str, tuple[int, int]]]) -> torch.Tensor:
        """pixel_values [patches, 3 p^2] of ``images`` (entries of :meth:`image_list`)."""
        pv = [load_patches(p, g, self.patch_size, self.mean, self.std) for p, g in images]
        return torch.cat(pv) if pv else torch.zeros(0, 3 * self.patch_size ** 2)

    def images(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, 3 p^2], image_grid [images, 2]) of example ``i``."""
        return self.load_pixels(self.image_list(i)), self.image_grid(i)

    def image_grid(self, i: int) -> torch.Tensor:
        return torch.tensor(self.examples[i][3], dtype=torch.long).view(-1, 2)

    def item(self, i: int, pixels: bool = True) -> dict[str, torch.Tensor]:
        """Example ``i``; without ``pixels`` its images are not read (``image_grid`` only)."""
        ids, labels, _, _ = self.examples[i]
        out = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
               "image_grid": self.image_grid(i)}
        if pixels:
            try:
                out["pixel_values"] = self.load_pixels(self.image_list(i))
            except DataError as e:
                raise type(e)(f"{self.ids[i]}: {e}") from None
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.item(i)

    def pack(self, pack_size: int, pad_to_multiple_of: int = 1) -> "PackedVisionDataset":
        return PackedVisionDataset(self, pack_size, pad_to_multiple_of)

    def collator(self) -> "VisionCollator":
        return VisionCollator(PaddingCollator(self.pad_token_id))


class PackedVisionDataset(torch.utils.data.Dataset):
    """Rows of several examples (first-fit decreasing by length), their images concatenated."""

    def __init__(self, dataset: VisionChatDataset, pack_size: int, pad_to_multiple_of: int = 1):
        _check(pack_size, pad_to_multiple_of)
        too_long = [dataset.record_id(i) for i, n in enumerate(dataset.lengths) if n > pack_size]
        if too_long:
            raise ValueError(f"packing.pack_size={pack_size} is shorter than {len(too_long)} "
                             f"examples (e.g. {too_long[0]}); raise it or set dataset.seq_length")
        self.dataset, self.pack_size = dataset, pack_size
        self.pad_token_id, self.pad_to_multiple_of = dataset.pad_token_id, pad_to_multiple_of
        self.bins = first_fit_decreasing([_round_up(n, pad_to_multiple_of)
                                          for n in dataset.lengths], pack_size)

    def __len__(self) -> int:
        return len(self.bins)

    def image_list(self, r: int) -> list[tuple[str, tuple[int, int]]]:
        return [x for i in self.bins[r] for x in self.dataset.image_list(i)]

    def load_pixels(self, images: Sequence[tuple[str, tuple[int, int]]]) -> torch.Tensor:
        return self.dataset.load_pixels(images)

    def item(self, r: int, pixels: bool = True) -> dict:
        """Row ``r``; without ``pixels`` its images are not read (``image_grid`` only)."""
        docs = [self.dataset.examples[i][:2] for i in self.bins[r]]
        row = build_row(docs, self.pack_size, self.pad_token_id, self.pad_to_multiple_of)
        row["image_grid"] = torch.cat([self.dataset.image_grid(i) for i in self.bins[r]])
        if pixels:
            row["pixel_values"] = self.load_pixels(self.image_list(r))
        row["doc_ids"] = list(self.bins[r])
        return row

    def __getitem__(self, r: int) -> dict:
        return self.item(r)

    def collator(self) -> "VisionCollator":
        return VisionCollator(PackedCollator())


class VisionCollator:
    """A text collator's batch plus the batch's images: ``pixel_values`` (when the examples
    hold them) and ``image_grid`` concatenated over the examples (or packed rows) in order."""

    def __init__(self, text_collator):
        self.text_collator = text_collator

    def __call__(self, examples: Sequence[dict]) -> dict[str, Any]:
        out = self.text_collator(examples)
        if "pixel_values" in examples[0]:
            out["pixel_values"] = torch.cat([e["pixel_values"] for e in examples])
        out["image_grid"] = torch.cat([e["image_grid"] for e in examples])
        return out


@text_reader("vision chat")
def build_vision_chat_dataset(path, tokenizer, **kwargs) -> VisionChatDataset:
    """``VisionChatDataset(path, tokenizer, **kwargs)``; the form a YAML ``_target_`` calls."""
    return VisionChatDataset(path, tokenizer, **kwargs)


def write_jsonl(path: str | os.PathLike, records: Sequence[Mapping]) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)
