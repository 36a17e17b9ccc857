"""Test data: the synthetic SFT generator, batches made by the project's collators, the test
tokenizer and the reference data of ``../shared/data``.

The reference data is optional: a test that needs it gets its path from :func:`require_shared`,
which skips the test (with the reason) when the folder is absent, or when
``HYBRIDTRAIN_TEST_SHARED=0`` asks the suite to behave as if it were (``tests/conftest.py`` then
also fails any test that opens a file there by another way). Every other test builds what it
needs, the test tokenizer included, so its outcome is the same with and without the folder.

::

    sft_examples(n, vocab_size=VOCAB, min_len=4, max_len=12, seed=0) -> list[dict]
    sft_dataset(n, ..., pack_size=None) -> SFTDataset, or its PackedDataset with pack_size
    collate(dataset, examples) -> dict            # hybridtrain.data.build_collator's batch
    make_loader(dataset, batch_sampler) -> DataLoader   # as the recipe's (its collator)
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from hybridtrain.data import IGNORE_INDEX, build_collator, pack_dataset

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
SQUAD_SUBSET = SHARED_DATA / "squad-v2-dev-subset.json"
SHARED_SWITCH = "HYBRIDTRAIN_TEST_SHARED"  # "0": behave as if ../shared were absent
SHARED_EVENT = "hybridtrain.tests.require_shared"  # audit event: a test asked for the data

VOCAB = 48  # the tiny models' vocabulary
PAD = 0  # the synthetic data's pad token (never a content token)


# -- the synthetic SFT generator ---------------------------------------------------------------
def sft_examples(n: int, vocab_size: int = VOCAB, min_len: int = 4, max_len: int = 12,
                 seed: int = 0) -> list[dict]:
    """``n`` examples of uneven length (``min_len..max_len`` tokens, ids ``1..vocab_size-1``),
    each a prompt without labels and a supervised answer: ``labels[t] = input_ids[t+1]`` on the
    answer, -100 on the prompt and on the last token (already shifted, as the datasets make)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (), generator=g))
        ids = torch.randint(1, vocab_size, (length,), generator=g)
        prompt = int(torch.randint(1, length - 1, (), generator=g))
        labels = torch.full((length,), IGNORE_INDEX)
        labels[prompt - 1 : length - 1] = ids[prompt:]
        out.append({"input_ids": ids, "labels": labels})
    return out


class SFTDataset(torch.utils.data.Dataset):
    """A list of examples carrying ``pad_token_id`` (what ``build_collator`` and
    ``pack_dataset`` read from a dataset)."""

    pad_token_id = PAD

    def __init__(self, examples: list[dict]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        return self.examples[i]


def sft_dataset(n: int, vocab_size: int = VOCAB, min_len: int = 4, max_len: int = 12,
                seed: int = 0, pack_size: int | None = None):
    """:func:`sft_examples` as a dataset; with ``pack_size`` packed by ``pack_dataset``. Also a
    recipe's ``dataset`` target (``_target_: tests.helpers.data.sft_dataset``)."""
    ds = SFTDataset(sft_examples(n, vocab_size, min_len, max_len, seed))
    return pack_dataset(ds, pack_size) if pack_size else ds


def collate(dataset, examples) -> dict:
    """One batch of ``examples`` (items of ``dataset``) by the dataset's own collator."""
    return build_collator(dataset)(list(examples))


def make_loader(dataset, batch_sampler) -> DataLoader:
    """The recipe's loader over ``dataset``: ``batch_sampler``'s index lists, the collator of
    ``build_collator``."""
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=build_collator(dataset),
                      generator=torch.Generator())


def label_tokens(example) -> list[int]:
    labels = example["labels"]
    return labels[labels != IGNORE_INDEX].tolist()


# -- reference data (optional) and the test tokenizer ----------------------------------------
_TOKENIZERS: dict[str, object] = {}


def shared_data_enabled() -> bool:
    """Whether the tests may use ``../shared/data`` (``HYBRIDTRAIN_TEST_SHARED=0`` says no)."""
    return os.environ.get(SHARED_SWITCH, "1") != "0"


def require_shared(path: Path) -> Path:
    """``path`` (a file of ``../shared/data``), or skip the calling test saying why."""
    sys.audit(SHARED_EVENT, str(path))  # the suite's watch notes the test (tests/conftest.py)
    if not shared_data_enabled():
        pytest.skip(f"reference data switched off ({SHARED_SWITCH}=0): {path}")
    if not path.is_file():
        pytest.skip(f"reference data not found: {path} (the ../shared/data folder is absent)")
    return path


def require_squad_subset() -> Path:
    return require_shared(SQUAD_SUBSET)


# stdlib modules whose docstrings give the test tokenizer plain English words
_ENGLISH_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "codecs", "collections", "contextlib",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
    "functools", "hashlib", "heapq", "inspect", "itertools", "json", "locale", "logging", "os",
    "pathlib", "pickle", "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "unittest", "uuid",
    "zipfile",
)


def tokenizer_corpus() -> list[str]:
    """The test tokenizer's training text, generated here (the same with or without
    ``../shared``): the synthetic SQuAD world, its questions in the SQuAD prompt template, chat
    role words, and English from the docstrings of a fixed list of stdlib modules (enough text
    for the full 3000-token vocabulary on any recent Python)."""
    from hybridtrain.data import synthetic_squad, synthetic_texts
    from hybridtrain.data.squad import DEFAULT_PROMPT_TEMPLATE

    texts = synthetic_texts(400, seed=0)
    texts += ["system user assistant tool Hello! How are you? I am fine, thanks."] * 5
    for article in synthetic_squad(400, seed=1)["data"]:
        for par in article["paragraphs"]:
            for qa in par["qas"]:
                prompt = DEFAULT_PROMPT_TEMPLATE.format(context=par["context"], question=qa["question"])
                texts.append(f"{prompt} {qa['answers'][0]['text']}")
    for name in _ENGLISH_MODULES:
        module = importlib.import_module(name)
        docs = [module.__doc__] + [inspect.getdoc(obj) for _, obj in sorted(vars(module).items())
                                   if inspect.isfunction(obj) or inspect.isclass(obj)]
        # one line each: runs of whitespace would teach merges that piece-wise tokenization
        # (the chat-mask oracles) does not reproduce
        texts += [" ".join(d.split()) for d in docs if d]
    return texts


def bpe_tokenizer(tmp_path_factory, vocab_size: int = 3000):
    """A byte-level BPE trained on :func:`tokenizer_corpus`; cached per process."""
    key = f"bpe{vocab_size}"
    if key not in _TOKENIZERS:
        from hybridtrain.data import build_bpe_tokenizer

        out = tmp_path_factory.mktemp("tokenizer")
        _TOKENIZERS[key] = build_bpe_tokenizer(tokenizer_corpus(), out, vocab_size=vocab_size)
    return _TOKENIZERS[key]


def squad_subset_tokenizer(tmp_path_factory, vocab_size: int = 3000):
    """A byte-level BPE trained on the reference SQuAD subset's text (skips without it), for the
    tests that read that subset; cached per process."""
    path = require_squad_subset()
    key = f"squad{vocab_size}"
    if key not in _TOKENIZERS:
        from hybridtrain.data import build_bpe_tokenizer

        texts = []
        for article in json.loads(path.read_text())["data"]:
            for par in article["paragraphs"]:
                texts.append(par["context"])
                texts.extend(qa["question"] for qa in par["qas"])
        out = tmp_path_factory.mktemp("squad_tokenizer")
        _TOKENIZERS[key] = build_bpe_tokenizer(texts + tokenizer_corpus(), out, vocab_size=vocab_size)
    return _TOKENIZERS[key]


# -- chat templates of the model families ------------------------------------------------------
CHAT_TEMPLATES = SHARED_DATA / "chat-templates"
NEMOTRON3_NANO_TEMPLATE = CHAT_TEMPLATES / "nvidia-nemotron-3-nano-30b-a3b.jinja"
NEMOTRON_NANO_9B_V2_TEMPLATE = CHAT_TEMPLATES / "nvidia-nemotron-nano-9b-v2.jinja"
CHAT_INSECURE_500 = SHARED_DATA / "emergent-misalignment-insecure-500.jsonl"

# the special tokens of the families' templates (Nemotron 3 Nano, Nemotron Nano 9B v2, Llama 3)
FAMILY_SPECIAL_TOKENS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
]


def chat_tokenizer(tmp_path_factory):
    """The test BPE (a fresh copy) with the families' chat special tokens added; cached."""
    if "chat" not in _TOKENIZERS:
        from transformers import AutoTokenizer

        base = bpe_tokenizer(tmp_path_factory)
        tok = AutoTokenizer.from_pretrained(base.name_or_path, local_files_only=True)
        tok.add_special_tokens({"additional_special_tokens": FAMILY_SPECIAL_TOKENS})
        _TOKENIZERS["chat"] = tok
    return _TOKENIZERS["chat"]
