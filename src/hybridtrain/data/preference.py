"""Preference pairs (DPO) in TRL's format, and a synthetic set that needs no download.

::

    build_preference_dataset(path, tokenizer, max_length=256, limit=None) -> PreferenceDataset
    preference_batch(pairs) -> dict        # the RL batch: chosen at even rows, rejected at odd
    write_synthetic_preferences(path, num_pairs=2000, seed=0) -> path
    synthetic_preference_texts(num_pairs=2000, seed=0) -> list[str]   # tokenizer training text

Records (``.jsonl``/``.json``/``.parquet``) hold ``prompt``, ``chosen`` and ``rejected``, either
plain text (``{"prompt": "...", "chosen": "...", "rejected": "..."}``: tokens of the prompt,
then of the response and the end-of-sequence token) or conversations (``prompt`` a list of
messages, ``chosen``/``rejected`` the assistant message(s) that follow: rendered with the
tokenizer's chat template, the response being what the whole conversation adds to the prompt
rendered with its generation prompt). Only the response tokens are trained on. A pair longer
than ``max_length`` tokens is cut there (a pair whose response would vanish is dropped). Pairs
that cannot teach a preference (chosen identical to rejected, after the cut, or chosen empty)
are counted and warned about with their lines, and refused when they are all of the data.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from hybridtrain.fileio import text_reader

from .io import DataError, check_count, iter_records, require
from .templates import apply_template

logger = logging.getLogger("hybridtrain.data")

__all__ = ["PreferenceDataset", "build_preference_dataset", "preference_batch",
           "write_synthetic_preferences", "synthetic_preference_texts"]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer, messages: list, generation_prompt: bool, where: str) -> list[int]:
    ids = apply_template(tokenizer, messages, where, tokenize=True,
                         add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding, or ids


def _as_messages(value: Any, role: str) -> list:
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def _check_side(key: str, value: Any, where: str) -> None:
    """``value`` of field ``key`` is text or a list of messages (``{role, content}`` objects)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(
            isinstance(m, dict) and "role" in m for m in value)):
        return
    got = (f"a list holding {sorted({type(m).__name__ for m in value})}"
           if isinstance(value, list) and value else
           "an empty list" if isinstance(value, list) else type(value).__name__)
    raise DataError(f"{where}: '{key}' must be text or a list of messages ({{\"role\": ..., "
                    f"\"content\": ...}} objects), got {got}")


def tokenize_pair(tokenizer, record: dict, where: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen response ids, rejected response ids) of one record."""
    prompt = require(record, "prompt", where, "TRL's preference format: prompt/chosen/rejected")
    chosen, rejected = (require(record, k, where) for k in ("chosen", "rejected"))
    for key, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        _check_side(key, value, where)
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return _encode(tokenizer, prompt), _encode(tokenizer, chosen) + eos, \
            _encode(tokenizer, rejected) + eos
    if not isinstance(prompt, list):
        raise DataError(f"{where}: 'prompt' is text while 'chosen'/'rejected' are messages; "
                        "give all three as text, or 'prompt' as a list of messages too")
    head = _render(tokenizer, prompt, True, where)
    out = []
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        full = _render(tokenizer, prompt + _as_messages(value, "assistant"), False, where)
        if full[: len(head)] != head:
            raise DataError(f"{where}: the chat template renders the prompt differently when "
                            f"{key!r} follows it; give plain text or a template whose prompt is "
                            "a prefix of the conversation")
        out.append(full[len(head):])
    return head, out[0], out[1]


class PreferenceDataset(torch.utils.data.Dataset):
    """Tokenized pairs: item ``i`` is ``{"prompt": ids, "chosen": ids, "rejected": ids}``."""

    def __init__(self, pairs: list[dict]):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        return self.pairs[i]


def _is_empty(value: Any) -> bool:
    """A response with no text: ``""`` or messages whose contents are all empty."""
    if isinstance(value, str):
        return not value.strip()
    return all(not str(m.get("content") or "").strip() for m in value)


# Pairs that cannot teach a preference (the DPO loss stays at ln 2 or pushes towards nothing).
_UNTEACHABLE = {"identical": "chosen and rejected are identical",
                "empty_chosen": "chosen is empty"}


def _warn_untaught(path, bad: dict[str, list[str]], total: int) -> None:
    """Warns about (refuses, when they are all the data) the pairs that cannot teach."""
    n = sum(len(v) for v in bad.values())
    if not n:
        return
    parts = "; ".join(f"{len(where)} pairs where {_UNTEACHABLE[k]} ({', '.join(where[:3])}"
                      f"{', ...' if len(where) > 3 else ''})" for k, where in bad.items() if where)
    if n == total:
        raise DataError(f"{path}: none of the {total} preference pairs can teach a preference: "
                        f"{parts}; fix the data")
    logger.warning("%s: %d of %d preference pairs cannot teach a preference: %s", path, n,
                   total, parts)


@text_reader("preference")
def build_preference_dataset(path: str | os.PathLike, tokenizer, max_length: int = 256,
                             limit: int | None = None) -> PreferenceDataset:
    pairs, dropped = [], 0
    bad: dict[str, list[str]] = {k: [] for k in _UNTEACHABLE}
    for where, record in iter_records(path):
        if limit is not None and len(pairs) >= limit:
            break
        prompt, chosen, rejected = tokenize_pair(tokenizer, record, where)
        room = max_length - len(prompt)
        if room < 1 or not chosen or not rejected:
            dropped += 1
            continue
        if _is_empty(record["chosen"]):
            bad["empty_chosen"].append(where)
        elif chosen[:room] == rejected[:room]:
            bad["identical"].append(where)
        pairs.append({"prompt": prompt, "chosen": chosen[:room], "rejected": rejected[:room]})
    if not pairs:
        raise DataError(f"{path}: no preference pair left (dropped {dropped} whose prompt "
                        f"reaches max_length={max_length}); raise max_length")
    _warn_untaught(path, bad, len(pairs))
    return PreferenceDataset(pairs)


def response_batch(rows: list[tuple[list[int], int]], pad_token_id: int = 0) -> dict:
    """The RL batch of ``rows`` of ``(prompt + response tokens, prompt length)``: right-padded,
    ``token_mask`` 1 on the response tokens, every ``sample_mask`` 1."""
    S = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), S), pad_token_id, dtype=torch.long)
    token_mask = torch.zeros(len(rows), S)
    for i, (r, n_prompt) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        token_mask[i, n_prompt: len(r)] = 1
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r, _ in rows]),
            "token_mask": token_mask, "sample_mask": torch.ones(len(rows))}


def preference_batch(pairs: list[dict], pad_token_id: int = 0) -> dict:
    """The RL batch of ``pairs``: rows ``prompt + chosen`` (even) and ``prompt + rejected``
    (odd), right-padded; ``token_mask`` 1 on the response tokens."""
    return response_batch([(p["prompt"] + p[key], len(p["prompt"])) for p in pairs
                           for key in ("chosen", "rejected")], pad_token_id)


# -- the synthetic set ----------------------------------------------------------------------------
_THINGS = ["apple", "sky", "grass", "snow", "coal", "sun", "lemon", "cherry", "ocean", "cloud",
           "leaf", "rose", "banana", "milk", "ink", "gold", "silver", "tomato", "carrot", "plum",
           "lime", "salt", "pepper", "frog", "crow", "swan", "flamingo", "pumpkin", "violet", "sand"]
_COLORS = ["red", "blue", "green", "white", "black", "yellow", "orange", "purple", "grey", "pink",
           "brown", "golden"]
_ASK = ["What color is the {t}?", "Tell me the color of the {t}.", "Which color does the {t} have?"]


def _pairs(num_pairs: int, seed: int) -> list[dict]:
    """Questions about the colour of things in a fixed invented world: chosen, the thing's colour
    in a full sentence; rejected, a wrong colour or the sentence's words out of order."""
    world = random.Random(1234)
    color = {t: world.choice(_COLORS) for t in _THINGS}
    rng = random.Random(seed)
    out = []
    for _ in range(num_pairs):
        t = rng.choice(_THINGS)
        chosen = f"The {t} is {color[t]}."
        if rng.random() < 0.5:
            wrong = rng.choice([c for c in _COLORS if c != color[t]])
            rejected = f"The {t} is {wrong}."
        else:
            words = chosen.rstrip(".").split()
            while " ".join(words) + "." == chosen:
                rng.shuffle(words)
            rejected = " ".join(words) + "."
        out.append({"prompt": rng.choice(_ASK).format(t=t) + " ", "chosen": chosen,
                    "rejected": rejected})
    return out


def synthetic_preference_texts(num_pairs: int = 2000, seed: int = 0) -> list[str]:
    return [p["prompt"] + p[k] for p in _pairs(num_pairs, seed) for k in ("chosen", "rejected")]


def write_synthetic_preferences(path: str | os.PathLike, num_pairs: int = 2000, seed: int = 0) -> str:
    """Writes ``num_pairs`` synthetic pairs (plain text, TRL's format) as JSONL; returns the path."""
    check_count(num_pairs, "write_synthetic_preferences num_pairs")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        for p in _pairs(num_pairs, seed):
            f.write(json.dumps(p) + "\n")
    os.replace(tmp, path)
    return str(path)
