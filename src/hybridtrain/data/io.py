"""File reading and error reporting for the data layer.

Every user mistake in a data file raises a :class:`DataError` (a ``ValueError``) that names the
file and, where there is one, the line, record and field, so the user can go and fix it:

- :class:`MalformedJSONError`  -- a JSON/JSONL file that does not parse (file + line number)
- :class:`MissingFieldError`   -- a record without a required field (field + record)
- :class:`AnswerMismatchError` -- a SQuAD answer that is not in its context (record)
- :class:`ChatFormatError`     -- a conversation that cannot be trained on (record + reason)
- :class:`EmptyDatasetError`   -- nothing left after filtering (how many dropped, and why)
- :class:`EncodingError`       -- bytes that are not UTF-8 (file + line + column)

Readers:

- ``resolve_data_files(path, split=None) -> list[Path]``: a file, a glob, or a directory
  (files whose name starts with ``split`` when one is given).
- ``choose_split(path, split, default_split=None) -> split``: a directory of several splits
  (``train.jsonl``, ``validation.jsonl``) is read for one split, never as one dataset.
- ``iter_records(path) -> Iterator[(where, record)]``: flat records from ``.jsonl`` (one object
  per line), ``.json`` (a list of objects, or one object) or ``.parquet``; ``where`` is a
  human-readable location such as ``"data.jsonl line 17"``.
- ``load_json(path)``: a whole JSON document, with line-numbered parse errors.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hybridtrain import fileio

JSON_SUFFIXES = (".json",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
DATA_SUFFIXES = JSON_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES

logger = logging.getLogger("hybridtrain.data")


class DataError(ValueError):
    """Base class of every data-layer user error."""


class MalformedJSONError(DataError):
    def __init__(self, path: str | os.PathLike, line: int, detail: str):
        self.path, self.line, self.detail = str(path), line, detail
        super().__init__(f"{path}: line {line}: malformed JSON: {detail}")


class MissingFieldError(DataError):
    def __init__(self, field: str, where: str, hint: str = ""):
        self.field, self.where = field, where
        msg = f"{where}: missing required field '{field}'"
        super().__init__(msg + (f" ({hint})" if hint else ""))


class AnswerMismatchError(DataError):
    pass


class ChatFormatError(DataError):
    pass


class EmptyDatasetError(DataError):
    def __init__(self, source: str, total: int, dropped: Mapping[str, int]):
        self.source, self.total, self.dropped = source, total, dict(dropped)
        if total == 0:
            super().__init__(f"{source}: empty dataset: the data holds no records")
            return
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items())) or "none"
        super().__init__(
            f"{source}: empty dataset: no examples left after filtering: {total} records read, "
            f"dropped: {reasons}. {describe_drop_reasons(dropped)}"
        )


# Human explanations for the drop-reason keys used by squad.py and chat.py.
DROP_REASON_HELP = {
    "unanswerable": "unanswerable SQuAD v2 questions are skipped unless `unanswerable_answer` is set",
    "too_long": "the question and answer alone do not fit in seq_length; raise seq_length",
    "too_long_no_truncation": "the example is longer than seq_length and truncation is off",
    "answer_not_in_context": "the answer text was not found in the context",
    "no_supervised_tokens": "the conversation has no assistant tokens to train on",
    "empty_assistant_content": "every assistant turn to train on has empty content",
    "no_supervised_tokens_after_truncation": (
        "after cutting at seq_length no assistant token is left; raise seq_length"
    ),
}


def describe_drop_reasons(dropped: Mapping[str, int]) -> str:
    parts = [DROP_REASON_HELP[r] for r in sorted(dropped) if dropped[r] and r in DROP_REASON_HELP]
    return ("(" + "; ".join(parts) + ")") if parts else ""


def record_name(where: str, record: Mapping[str, Any] | None = None) -> str:
    """``where`` plus the record's id when it has one: ``"f.jsonl line 3 (id 'abc')"``."""
    if isinstance(record, Mapping):
        rid = record.get("id", record.get("_id"))
        if rid is not None and rid != "":
            return f"{where} (id {rid!r})"
    return where


# split names a data file's name may start with (``train-00000-of-00002.parquet``), by split
SPLIT_NAMES = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev", "eval"),
    "test": ("test",),
}
_SPLIT_RE = re.compile(
    r"^(" + "|".join(sorted((n for ns in SPLIT_NAMES.values() for n in ns), key=len, reverse=True))
    + r")(?=$|[-_.])", re.IGNORECASE)


def split_of(file: str | os.PathLike) -> str | None:
    """The split name a data file's name starts with (``"dev"`` for ``dev.jsonl``), or None."""
    m = _SPLIT_RE.match(Path(file).name)
    return m.group(1) if m else None


def choose_split(path, split: str | None, default_split: str | None = None) -> str | None:
    """The ``split`` to read ``path`` with. A directory holding the files of several splits
    (``train.jsonl`` and ``validation.jsonl``) without ``split`` is read for ``default_split``
    (the recipe's section: ``"train"`` or ``"validation"``, any of its names in
    :data:`SPLIT_NAMES`), else refused naming the files: it is never read as one dataset."""
    if split is not None or not isinstance(path, (str, os.PathLike)):
        return split
    p = Path(os.path.expanduser(str(path)))
    if not p.is_dir():
        return split
    files = sorted(f.name for f in p.iterdir() if f.is_file() and f.name.endswith(DATA_SUFFIXES))
    groups = {split_of(f) for f in files}
    if len(groups) <= 1:
        return None
    wanted = [g for g in groups if g and g.lower() in SPLIT_NAMES.get(default_split or "", ())]
    if len(wanted) == 1:
        logger.info("%s holds several splits (%s): the %s dataset reads split '%s'", p,
                    ", ".join(files), default_split, wanted[0])
        return wanted[0]
    raise DataError(
        f"{p} holds the data files of several splits ({', '.join(files)}) and `split` is not "
        "set: set split (e.g. split: train) to read one of them, or point path at a file; "
        "they are never read as one dataset")


def resolve_data_files(path: str | os.PathLike, split: str | None = None) -> list[Path]:
    """The data files meant by ``path``: a file, a glob pattern, or a directory.

    For a directory, ``split`` (e.g. ``"train"``) selects the files whose name starts with it
    (``train.jsonl``, ``train-00000-of-00002.parquet``); without ``split`` all data files are used.
    """
    p = Path(os.path.expanduser(str(path)))
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(DATA_SUFFIXES))
        if split is not None:
            files = [f for f in files if f.name.startswith(split)]
        if not files:
            what = f"data files for split '{split}'" if split else "data files"
            raise DataError(
                f"{p}: no {what} ({', '.join(DATA_SUFFIXES)}) in this directory"
            )
        return files
    matches = sorted(Path(m) for m in glob.glob(str(p)) if Path(m).is_file())
    if matches:
        return matches
    if p.is_symlink():
        raise DataError(f"{path}: a symbolic link that leads to itself or nowhere "
                        f"(-> {os.readlink(p)}); point it at the data file")
    raise DataError(f"{path}: no such data file or directory")


class EncodingError(DataError, fileio.EncodingError):
    pass


def decode_utf8(data: bytes, path, line: int | None = None) -> str:
    """``data`` as UTF-8 text; bytes that are not UTF-8 raise :class:`EncodingError` naming the
    file, line and column (``line``: the line ``data`` is, else counted in ``data``)."""
    return fileio.decode_utf8(data, path, line, error=EncodingError)


@fileio.text_reader("json")
def load_json(path: str | os.PathLike) -> Any:
    """Parse a whole JSON file; a syntax error names the file and line."""
    path = Path(path)
    text = decode_utf8(path.read_bytes(), path)
    try:
        return fileio.json_loads(text)
    except json.JSONDecodeError as e:
        raise MalformedJSONError(path, e.lineno, f"{e.msg} (column {e.colno})") from None


@fileio.text_reader("jsonl")
def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """``(line_number, object)`` for each non-blank line of a JSONL file (1-based lines)."""
    path = Path(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = decode_utf8(raw, path, lineno)
            if not line.strip():
                continue
            try:
                obj = fileio.json_loads(line)
            except json.JSONDecodeError as e:
                raise MalformedJSONError(path, lineno, f"{e.msg} (column {e.colno})") from None
            if not isinstance(obj, dict):
                raise MalformedJSONError(
                    path, lineno, f"expected a JSON object per line, got {type(obj).__name__}"
                )
            yield lineno, obj


def iter_parquet(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """``(row_index, row_dict)`` for each row of a Parquet file (0-based rows)."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable Parquet file: {e}") from None
    row = 0
    for batch in pf.iter_batches(batch_size=4096):
        for rec in batch.to_pylist():
            yield row, rec
            row += 1


@fileio.text_reader("jsonl")
def iter_records(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Flat records of one file as ``(where, record)``; ``where`` names file and line/row."""
    path = Path(path)
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        for lineno, rec in iter_jsonl(path):
            yield f"{path} line {lineno}", rec
    elif name.endswith(PARQUET_SUFFIXES):
        for row, rec in iter_parquet(path):
            yield f"{path} row {row}", rec
    elif name.endswith(JSON_SUFFIXES):
        obj = load_json(path)
        label = "record"
        if isinstance(obj, dict) and isinstance(obj.get("data"), list):
            obj, label = obj["data"], "data"
        if isinstance(obj, dict):
            obj = [obj]
        if not isinstance(obj, list):
            raise DataError(f"{path}: expected a JSON list of records, got {type(obj).__name__}")
        for i, rec in enumerate(obj):
            where = f"{path} data[{i}]" if label == "data" else f"{path} record {i}"
            if not isinstance(rec, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            yield where, rec
    else:
        raise DataError(
            f"{path}: unknown data file type; expected one of {', '.join(DATA_SUFFIXES)}"
        )


MAX_SYNTHETIC = 10_000_000  # records a synthetic-data writer makes at most


def check_count(value: Any, name: str, most: int = MAX_SYNTHETIC) -> int:
    """``value`` when it is a whole number in ``[1, most]`` (how many records a synthetic-data
    writer makes); else a :class:`DataError` naming the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise DataError(f"{name}={value!r}: give a whole number of records from 1 to {most:,}")
    return value


def require(record: Mapping[str, Any], field: str, where: str, hint: str = "") -> Any:
    """``record[field]``, or a :class:`MissingFieldError` naming the field and the record."""
    if not isinstance(record, Mapping) or field not in record or record[field] is None:
        raise MissingFieldError(field, record_name(where, record), hint)
    return record[field]
