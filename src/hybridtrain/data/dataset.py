"""Tokenized datasets and their on-disk cache.

``TokenizedDataset`` is the map-style dataset that ``build_squad_dataset`` and
``build_chat_dataset`` return (through ``SourceDataset``, which tokenizes a source itself). Item ``i`` is a dict of 1-D ``torch.long`` tensors:

- ``input_ids``: the document (right-padded with the pad token to ``seq_length`` when
  ``padding="max_length"``)
- ``labels``: already shifted -- ``labels[t] == input_ids[t + 1]`` where token ``t + 1`` is
  supervised, else ``-100``; the last token of a document and all padding have ``-100``, so no
  label ever points past the end of its document. Compute the loss as
  ``cross_entropy(logits[t], labels[t])`` with no further shift.
- ``attention_mask``: 1 on document tokens, 0 on padding.

Attributes: ``lengths`` (unpadded lengths, numpy), ``num_label_tokens`` (numpy), ``stats`` (how
many records were read, kept, and dropped for which reason), ``pad_token_id``, ``cache_path``.

Caching: the tokenized examples are written once with ``datasets`` (Arrow) under
``cache_dir/<kind>-<key>/`` and memory-mapped afterwards. ``key`` hashes the source files (path,
size, mtime) or the source ``datasets`` fingerprint, the tokenizer fingerprint and every option
that changes the output, so changing any of them re-tokenises. ``cache_dir=None`` uses
``$HYBRIDTRAIN_DATA_CACHE`` or ``<HF datasets cache>/hybridtrain``; ``cache_dir=False`` keeps
everything in memory. A file lock makes concurrent ranks build once and share the result.
An entry that cannot be read (a truncated Arrow file, a damaged record) is named in a warning
and rebuilt.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridtrain.fileio import read_json

from .batch import IGNORE_INDEX
from .io import DataError, EmptyDatasetError, describe_drop_reasons, resolve_data_files
from .tokenizer import tokenizer_fingerprint

logger = logging.getLogger("hybridtrain.data")

CACHE_FORMAT_VERSION = 1


class CorruptCacheError(DataError):
    """A tokenized-data cache entry that cannot be read (it is rebuilt once)."""


def default_cache_dir() -> Path:
    env = os.environ.get("HYBRIDTRAIN_DATA_CACHE")
    if env:
        return Path(env)
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "hybridtrain"


def file_fingerprint(paths) -> list[list]:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append([str(Path(p).resolve()), st.st_size, st.st_mtime_ns])
    return out


def source_key(path, split: str | None = None) -> tuple[str, Any]:
    """``(name for messages, cache-key part)`` of a data source: a ``datasets.Dataset`` (its
    fingerprint) or local files (their path, size and mtime)."""
    if hasattr(path, "column_names") and hasattr(path, "_fingerprint"):
        return f"datasets.Dataset({path._fingerprint})", path._fingerprint
    files = resolve_data_files(path, split)
    if len(files) > 1 or str(files[0]) != os.path.expanduser(str(path)):
        logger.info("%s: reading %s", path, ", ".join(f.name for f in files))
    return str(path), file_fingerprint(files)


def check_padding(padding: str, seq_length: int | None) -> None:
    if padding not in ("none", "max_length"):
        raise ValueError(f"padding must be 'none' or 'max_length', got {padding!r}")
    if padding == "max_length" and not seq_length:
        raise ValueError("padding='max_length' needs seq_length (the fixed length)")


def hash_key(parts: Mapping[str, Any]) -> str:
    blob = json.dumps({"v": CACHE_FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def shifted_labels(input_ids: list[int], supervised: list[bool]) -> list[int]:
    """``labels[t] = input_ids[t+1]`` if token ``t+1`` is supervised, else -100; last is -100."""
    n = len(input_ids)
    labels = [IGNORE_INDEX] * n
    for t in range(n - 1):
        if supervised[t + 1]:
            labels[t] = input_ids[t + 1]
    return labels


class Stats(dict):
    """``{"read": N, "kept": K, "dropped": {reason: n}, "skipped": {reason: n}, ...}``."""


def tokenize_records(
    raw: dict[str, list],
    fn: Callable,
    fn_kwargs: dict,
    num_proc: int = 1,
    desc: str = "tokenizing",
    batch_size: int = 1000,
):
    """Run ``fn`` over ``raw`` (a dict of columns) with ``datasets.map``; split off the drops.

    ``fn(batch, **fn_kwargs)`` returns the columns ``id`` (the source record), ``input_ids``,
    ``labels``, ``length``, ``num_label_tokens`` and ``drop_reason`` (``""`` for a kept example).
    Returns ``(dataset_of_kept_examples, Counter(drop_reason))``.
    """
    import datasets

    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.List(datasets.Value("int32")),
            "labels": datasets.List(datasets.Value("int32")),
            "length": datasets.Value("int32"),
            "num_label_tokens": datasets.Value("int32"),
            "drop_reason": datasets.Value("string"),
        }
    )
    ds = datasets.Dataset.from_dict(raw)
    n = len(ds)
    if n == 0:
        return ds, Counter()
    num_proc = max(1, min(int(num_proc or 1), n // batch_size + 1))
    with _quiet_datasets():
        ds = ds.map(
            fn,
            fn_kwargs=fn_kwargs,
            batched=True,
            batch_size=batch_size,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=ds.column_names,
            features=features,
            new_fingerprint=hash_key({"map": desc, "n": n, "id": uuid.uuid4().hex}),
            load_from_cache_file=False,
            desc=desc,
        )
    reasons = np.asarray(ds.data.column("drop_reason").to_numpy(zero_copy_only=False))
    drops = Counter(str(r) for r in reasons[reasons != ""])
    if drops:
        keep = np.nonzero(reasons == "")[0]
        ds = ds.select(keep)
    ds = ds.remove_columns("drop_reason")
    return ds, drops


class _quiet_datasets:
    """Hide the per-call progress bars of ``datasets`` (the data layer logs its own summary)."""

    def __enter__(self):
        import datasets

        self._was = datasets.utils.logging.is_progress_bar_enabled()
        datasets.utils.logging.disable_progress_bar()

    def __exit__(self, *exc):
        import datasets

        if self._was:
            datasets.utils.logging.enable_progress_bar()


def build_cached(
    kind: str,
    key_parts: Mapping[str, Any],
    cache_dir: str | os.PathLike | None | bool,
    build: Callable[[], tuple[Any, dict]],
):
    """Load ``kind`` keyed by ``key_parts`` from the cache, or ``build()`` and save it.

    ``build`` returns ``(datasets.Dataset, stats)``. Returns ``(dataset, stats, path_or_None)``.
    """
    import datasets

    if cache_dir is False:
        ds, stats = build()
        if ds._indices is not None:
            with _quiet_datasets():
                ds = ds.flatten_indices()
        return ds, stats, None
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{kind}-{hash_key(key_parts)}"
    meta_file = final / "hybridtrain_meta.json"

    def load():
        try:
            stats = Stats(read_json(meta_file)["stats"])
        except Exception as e:  # a damaged or half-written record
            raise CorruptCacheError(f"the tokenized-data cache {final} cannot be read "
                                    f"({meta_file}: {type(e).__name__}: "
                                    f"{str(e).strip()[:200]})") from e
        if not stats.get("kept"):  # an empty entry (earlier versions wrote them): build again
            return (*build(), None)
        try:
            with _quiet_datasets():
                ds = datasets.load_from_disk(str(final))
            missing = {"input_ids", "labels", "length", "num_label_tokens"} - set(ds.column_names)
            if missing or len(ds) != stats["kept"]:
                raise ValueError(f"it holds {len(ds)} rows ({', '.join(sorted(missing))} missing)"
                                 if missing else f"it holds {len(ds)} rows, its record says "
                                 f"{stats['kept']}")
        except Exception as e:  # Arrow or file errors of a damaged entry
            raise CorruptCacheError(
                f"the tokenized-data cache {final} cannot be read ({type(e).__name__}: "
                f"{str(e).strip()[:200]})") from e
        return ds, stats, final

    if meta_file.is_file():
        try:
            return load()
        except CorruptCacheError as e:
            logger.warning("%s; rebuilding it", e)
    from filelock import FileLock

    with FileLock(str(final) + ".lock"):
        if meta_file.is_file():  # another process built it while we waited
            try:
                return load()
            except CorruptCacheError:
                pass
        ds, stats = build()
        if len(ds) == 0:  # nothing to cache (the caller reports why); Arrow cannot reload it
            return ds, stats, None
        tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        with _quiet_datasets():
            ds.save_to_disk(str(tmp))
        (tmp / "hybridtrain_meta.json").write_text(
            json.dumps({"key": dict(key_parts), "stats": stats}, indent=1, default=str)
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    try:
        return load()
    except CorruptCacheError as e:
        raise CorruptCacheError(f"{e}; it was just written: check the disk, or set the "
                                "dataset's cache_dir to another folder (false: no cache)") from e


def build_source(kind: str, path, split: str | None, tokenizer, seq_length: int | None,
                 cache_dir, key_parts: Mapping[str, Any], build: Callable[[], tuple[Any, dict]]):
    """The common end of a data source's builder: the cache entry of ``kind`` keyed by
    ``key_parts`` plus the source's and the tokenizer's fingerprints (``build()`` on a miss, see
    :func:`build_cached`), then :func:`report`. Returns ``(dataset, stats, cache path or None,
    pad id)``."""
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token (load_tokenizer sets pad = eos)")
    source, src_key = source_key(path, split)
    key = {"source": src_key, "tokenizer": tokenizer_fingerprint(tokenizer), **key_parts}
    ds, stats, cache_path = build_cached(kind, key, cache_dir, build)
    report(stats, source, seq_length)
    return ds, stats, cache_path, tokenizer.pad_token_id


# Why single turns of a kept example are not trained on (``stats["turns_skipped"]``).
TURN_SKIP_HELP = {"empty_assistant_content": "an empty answer teaches the model to say nothing"}


def report(stats: Mapping[str, Any], source: str, seq_length: int | None) -> None:
    """Raise if nothing is left; otherwise one warning for all drops and an info line."""
    dropped = {k: v for k, v in stats.get("dropped", {}).items() if v}
    skipped = {k: v for k, v in stats.get("skipped", {}).items() if v}
    if stats["kept"] == 0:
        raise EmptyDatasetError(source, stats["read"], {**skipped, **dropped})
    turns = {k: v for k, v in stats.get("turns_skipped", {}).items() if v}
    if dropped or turns:
        total = sum(dropped.values())
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(dropped.items())) or "none"
        extra = "".join(
            f"; {n} assistant turns not trained on ({r}: {TURN_SKIP_HELP.get(r, r)})"
            for r, n in sorted(turns.items())
        )
        logger.warning(
            "%s: dropped %d of %d examples (seq_length=%s): %s %s%s",
            source, total, stats["read"], seq_length, reasons, describe_drop_reasons(dropped),
            extra,
        )
    extra = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items()))
    logger.info(
        "%s: %d examples kept of %d read%s%s",
        source, stats["kept"], stats["read"], f"; skipped {extra}" if extra else "",
        f"; repaired {stats['repaired']} answer_start" if stats.get("repaired") else "",
    )


class TokenizedDataset(torch.utils.data.Dataset):
    """Map-style dataset over a (memory-mapped) ``datasets.Dataset`` of tokenized examples."""

    def __init__(
        self,
        hf_dataset,
        pad_token_id: int,
        seq_length: int | None = None,
        padding: str = "none",
        stats: Mapping[str, Any] | None = None,
        cache_path: Path | None = None,
    ):
        check_padding(padding, seq_length)
        self.hf_dataset = hf_dataset
        self.pad_token_id = int(pad_token_id)
        self.seq_length = seq_length
        self.padding = padding
        self.stats = Stats(stats or {})
        self.cache_path = cache_path
        if hf_dataset._indices is not None:
            with _quiet_datasets():
                hf_dataset = self.hf_dataset = hf_dataset.flatten_indices()
        self._columns()
        self.lengths = np.asarray(hf_dataset.data.column("length").to_numpy(), dtype=np.int64)
        self.num_label_tokens = np.asarray(
            hf_dataset.data.column("num_label_tokens").to_numpy(), dtype=np.int64
        )

    def _columns(self):
        self._ids = self.hf_dataset.data.column("input_ids")
        self._labels = self.hf_dataset.data.column("labels")

    # A memory-mapped `datasets.Dataset` pickles by file reference; the Arrow column views we
    # keep for fast access would pickle by value, so they are rebuilt instead (DataLoader workers).
    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_ids", None)
        state.pop("_labels", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._columns()

    def __len__(self) -> int:
        return len(self.lengths)

    def record_id(self, i: int) -> str:
        """The source record of example ``i`` (its SQuAD id, or file and line)."""
        return self.hf_dataset.data.column("id")[i].as_py()

    def get_unpadded(self, i: int) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of example ``i`` as lists, without padding."""
        return self._ids[i].as_py(), self._labels[i].as_py()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        ids, labels = self.get_unpadded(i)
        n = len(ids)
        pad = self.seq_length - n if self.padding == "max_length" else 0
        return {
            "input_ids": torch.tensor(ids + [self.pad_token_id] * pad, dtype=torch.long),
            "labels": torch.tensor(labels + [IGNORE_INDEX] * pad, dtype=torch.long),
            "attention_mask": torch.tensor([1] * n + [0] * pad, dtype=torch.long),
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n={len(self)}, seq_length={self.seq_length}, "
            f"padding={self.padding!r}, stats={dict(self.stats)})"
        )


class SourceDataset(TokenizedDataset):
    """A ``TokenizedDataset`` that reads and tokenizes its source itself.

    A subclass sets ``_build = staticmethod(fn)``, ``fn(path, tokenizer, seq_length, padding,
    **options) -> (hf_dataset, stats, cache_path, pad_token_id)``; the subclass then takes exactly
    ``fn``'s arguments (its ``__signature__``, which YAML ``_target_`` checks).
    """

    _build: Callable[..., tuple]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__signature__ = inspect.signature(cls._build).replace(return_annotation=cls.__name__)

    def __init__(self, path, tokenizer, seq_length: int | None = None, padding: str = "none",
                 **kwargs):
        ds, stats, cache_path, pad_id = type(self)._build(path, tokenizer, seq_length, padding, **kwargs)
        super().__init__(ds, pad_id, seq_length=seq_length, padding=padding, stats=stats,
                         cache_path=cache_path)
