"""SQuAD question answering as prompt -> completion SFT data.

::

    build_squad_dataset(
        path,                      # SQuAD v1.1/v2.0 JSON, or flat .jsonl/.json/.parquet with the HF
                                   # `squad` columns, a directory (with `split`), a glob, or a
                                   # `datasets.Dataset` with those columns
        tokenizer,                 # a tokenizer object or a local tokenizer directory
        seq_length=None,           # max tokens per example (None: no limit)
        padding="none",            # "none" (variable length) | "max_length" (exactly seq_length)
        truncation=True,           # shorten the context so the example fits (never the answer)
        split=None,                # e.g. "train" when `path` is a directory
        default_split=None,        # without `split`: the split a directory of several splits
                                   # is read for (the recipe sets it: train / validation)
        prompt_template=DEFAULT_PROMPT_TEMPLATE,          # {context} {question} {title}
        completion_template=DEFAULT_COMPLETION_TEMPLATE,  # {answer}; eos is appended
        unanswerable_answer=None,  # None: skip unanswerable v2 questions; a string: train on it
        on_bad_record="raise",     # an answer that is not in its context: "raise" | "skip"
        cache_dir=None, num_proc=1, limit=None,
    ) -> TokenizedDataset

Every example is ``prompt + completion + eos`` with labels only on the completion and eos (shifted,
see ``dataset.py``): the label tokens decode to exactly ``completion_template`` with the answer,
followed by the eos token. The answer used is the first one, with surrounding whitespace removed.

Fitting into ``seq_length`` never removes answer tokens: when prompt + completion is too long the
context is replaced by a window of whole words around the answer (``answer_start``), as large as
fits; the window is found by re-tokenising the real prompt, so the length is exact. An example
whose prompt with only the answer as context, plus completion, still does not fit is dropped; all
drops are reported in one warning with their count (``dataset.stats["dropped"]``).

``read_squad(path, split=None, on_bad_record="raise")`` returns the normalised records.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from hybridtrain.fileio import text_reader

from .batch import IGNORE_INDEX
from .dataset import (
    SourceDataset,
    Stats,
    build_source,
    check_padding,
    tokenize_records,
)
from .io import (
    AnswerMismatchError,
    DataError,
    choose_split,
    iter_records,
    record_name,
    require,
    resolve_data_files,
)
from .tokenizer import as_tokenizer, encode_batch

DEFAULT_PROMPT_TEMPLATE = "Context: {context}\nQuestion: {question}\nAnswer:"
DEFAULT_COMPLETION_TEMPLATE = " {answer}"

_FIELD_RE = re.compile(r"\{(context|question|title|answer)\}")
_WORD_RE = re.compile(r"\S+")


def render(template: str, **values: str) -> str:
    """Fill ``{context}``, ``{question}``, ``{title}``, ``{answer}`` in one pass (other braces stay)."""
    return _FIELD_RE.sub(lambda m: values.get(m.group(1), m.group(0)), template)


# --------------------------------------------------------------------------- reading


def _answers_list(answers: Any, where: str) -> list[tuple[str, int | None]]:
    """HF columns ``{text: [...], answer_start: [...]}`` or SQuAD ``[{text, answer_start}]``."""
    if isinstance(answers, Mapping):
        texts = answers.get("text")
        starts = answers.get("answer_start")
        if texts is None:
            raise DataError(f"{where}: field 'answers' has no 'text'")
        if isinstance(texts, str):
            texts, starts = [texts], [starts] if not isinstance(starts, list) else starts
        starts = list(starts) if starts is not None else [None] * len(texts)
        if len(starts) < len(texts):
            starts += [None] * (len(texts) - len(starts))
        return [(t, s) for t, s in zip(texts, starts)]
    if isinstance(answers, list):
        out = []
        for k, a in enumerate(answers):
            if not isinstance(a, Mapping) or "text" not in a:
                raise DataError(f"{where}: answers[{k}] has no 'text'")
            out.append((a["text"], a.get("answer_start")))
        return out
    raise DataError(
        f"{where}: field 'answers' must be a list of {{text, answer_start}} or a dict of lists, "
        f"got {type(answers).__name__}"
    )


def _locate(context: str, text: str, start: int | None) -> int | None:
    """The start of ``text`` in ``context``: ``start`` if it matches, else the nearest occurrence."""
    if start is not None and start >= 0 and context[start : start + len(text)] == text:
        return start
    hits = [m.start() for m in re.finditer(re.escape(text), context)]
    if not hits:
        return None
    ref = start if start is not None and start >= 0 else 0
    return min(hits, key=lambda h: (abs(h - ref), h))


class _Reader:
    def __init__(self, on_bad_record: str):
        if on_bad_record not in ("raise", "skip"):
            raise ValueError(f"on_bad_record must be 'raise' or 'skip', got {on_bad_record!r}")
        self.on_bad_record = on_bad_record
        self.cols: dict[str, list] = {
            k: [] for k in ("id", "title", "context", "question", "answer", "answer_start", "answers")
        }
        self.read = 0
        self.skipped: Counter = Counter()
        self.dropped: Counter = Counter()
        self.repaired = 0

    def add(self, rec: Mapping, where: str, context: str | None = None, title: str = ""):
        self.read += 1
        name = record_name(where, rec)
        if context is None:
            context = require(rec, "context", where)
        if not isinstance(context, str):
            raise DataError(f"{name}: field 'context' must be a string")
        question = require(rec, "question", where)
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{name}: field 'question' must be a non-empty string")
        answers = rec.get("answers")
        impossible = bool(rec.get("is_impossible", False))
        pairs = _answers_list(answers, name) if answers is not None else []
        if not pairs and not impossible and answers is None:
            require(rec, "answers", where, "set 'is_impossible': true for an unanswerable question")
        if impossible or not pairs:
            text, start = "", -1
        else:
            raw, start0 = pairs[0]
            if not isinstance(raw, str) or not raw.strip():
                raise DataError(f"{name}: the first answer's 'text' is empty")
            text = raw.strip()
            if start0 is not None:
                try:
                    start0 = int(start0) + (len(raw) - len(raw.lstrip()))
                except (TypeError, ValueError):
                    raise DataError(f"{name}: answer_start {start0!r} is not an integer") from None
            start = _locate(context, text, start0)
            if start is None:
                if self.on_bad_record == "raise":
                    raise AnswerMismatchError(
                        f"{name}: answer {text!r} (answer_start={start0}) is not in the context; "
                        "fix the record or pass on_bad_record='skip'"
                    )
                self.dropped["answer_not_in_context"] += 1
                return
            if start != start0:
                self.repaired += 1
        for k, v in (
            ("id", str(rec.get("id") or where)),
            ("title", str(rec.get("title", title) or "")),
            ("context", context),
            ("question", question.strip()),
            ("answer", text),
            ("answer_start", start),
            ("answers", list(dict.fromkeys(t.strip() for t, _ in pairs if isinstance(t, str) and t.strip()))),
        ):
            self.cols[k].append(v)

    def add_article(self, art: Mapping, where: str):
        paragraphs = require(art, "paragraphs", where)
        title = str(art.get("title", "") or "")
        for j, par in enumerate(paragraphs):
            pwhere = f"{where}.paragraphs[{j}]"
            context = require(par, "context", pwhere)
            for k, qa in enumerate(require(par, "qas", pwhere)):
                self.add(qa, f"{pwhere}.qas[{k}]", context=context, title=title)


@text_reader("squad", arg="source")
def read_squad(source, split: str | None = None, on_bad_record: str = "raise") -> dict:
    """Normalised records of a SQuAD source: ``{"columns": {...}, "read", "skipped", ...}``.

    Columns: ``id, title, context, question, answer, answer_start`` (``answer == ""`` and
    ``answer_start == -1`` for an unanswerable question), ``answers`` (every reference answer).
    """
    r = _Reader(on_bad_record)
    if hasattr(source, "column_names") and hasattr(source, "__iter__"):  # datasets.Dataset
        for i, rec in enumerate(source):
            if "paragraphs" in rec:
                r.add_article(rec, f"dataset row {i}")
            else:
                r.add(rec, f"dataset row {i}")
    else:
        for f in resolve_data_files(source, split):
            for where, rec in iter_records(f):
                if "paragraphs" in rec:
                    r.add_article(rec, where)
                else:
                    r.add(rec, where)
    return {
        "columns": r.cols,
        "read": r.read,
        "dropped": dict(r.dropped),
        "repaired": r.repaired,
    }


# --------------------------------------------------------------------------- tokenising


def _word_window(words, a_s, a_e, extra):
    """Char span of the answer's words plus up to ``extra`` words split around them.

    Without an answer span (``a_e <= a_s``, an unanswerable question) the window starts at the
    beginning of the context. Returns ``(start, end, covers_all_words)``.
    """
    if a_e <= a_s:
        j = min(extra, len(words))
        return 0, (words[j - 1][1] if j else 0), j == len(words)
    i = next((k for k, (s, e) in enumerate(words) if e > a_s), len(words))
    j = next((k for k, (s, e) in enumerate(words) if s >= a_e), len(words))
    avail_l, avail_r = i, len(words) - j
    left = min(extra // 2, avail_l)
    right = min(extra - left, avail_r)
    left = min(extra - right, avail_l)
    i, j = i - left, j + right
    cs = min(words[i][0], a_s) if i < len(words) else a_s
    ce = max(words[j - 1][1], a_e) if j > 0 else a_e
    return cs, ce, left + right == avail_l + avail_r


def _fit_prompt(tok, ctx, a_s, a_e, n_full, prompt_of, budget):
    """Prompt ids with the largest word window of ``ctx`` around ``[a_s, a_e)`` within ``budget``."""
    enc = lambda text: encode_batch(tok, [text], add_special_tokens=True)[0]  # noqa: E731
    p_min = enc(prompt_of(ctx[a_s:a_e] if a_e > a_s else ""))
    if len(p_min) > budget:
        return None
    words = [m.span() for m in _WORD_RE.finditer(ctx)]
    if not words:
        return p_min
    overhead = len(enc(prompt_of("")))
    per_word = max(1e-3, (n_full - overhead) / len(words))
    extra = max(0, int((budget - overhead) / per_word) - 2)
    best, lo_fit, hi_fail = p_min, -1, None
    for _ in range(12):
        cs, ce, all_in = _word_window(words, a_s, a_e, extra)
        ids = enc(prompt_of(ctx[cs:ce]))
        if len(ids) <= budget:
            best, lo_fit = ids, extra
            slack = budget - len(ids)
            if all_in:
                break
            nxt = extra + max(1, int(slack / per_word))
            if hi_fail is not None:
                nxt = min(nxt, hi_fail - 1)
        else:
            hi_fail = extra
            nxt = extra - max(1, math.ceil((len(ids) - budget) / per_word))
            nxt = max(nxt, lo_fit + 1, 0)
            if hi_fail == 0:
                break
        if nxt == extra or nxt <= lo_fit or (hi_fail is not None and nxt >= hi_fail):
            break
        extra = nxt
    return best


def squad_tokenize_batch(
    batch: dict[str, list],
    tokenizer,
    prompt_template: str,
    completion_template: str,
    seq_length: int | None,
    truncation: bool,
    unanswerable_answer: str | None,
) -> dict[str, list]:
    """``datasets.map`` function: normalised SQuAD columns -> tokenized examples (see module doc)."""
    eos = tokenizer.eos_token_id
    ids_col, contexts, questions = batch["id"], batch["context"], batch["question"]
    titles, answers, starts = batch["title"], batch["answer"], batch["answer_start"]
    n = len(contexts)
    completions = [
        render(completion_template, answer=a if a else (unanswerable_answer or "")) for a in answers
    ]
    comp_ids = encode_batch(tokenizer, completions, add_special_tokens=False)

    def prompt_fn(i):
        q, t = questions[i], titles[i]
        return lambda c: render(prompt_template, context=c, question=q, title=t)

    prompts = [
        render(prompt_template, context=c, question=q, title=t)
        for c, q, t in zip(contexts, questions, titles)
    ]
    prompt_ids = encode_batch(tokenizer, prompts, add_special_tokens=True)
    out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "length", "num_label_tokens")}
    out["drop_reason"] = []
    out["id"] = list(ids_col)
    for i in range(n):
        comp = comp_ids[i]
        comp.append(eos)
        p = prompt_ids[i]
        reason = ""
        if seq_length is not None and len(p) + len(comp) > seq_length:
            if not truncation:
                reason = "too_long_no_truncation"
            elif "{context}" not in prompt_template:
                reason = "too_long"
            else:
                a_s = starts[i]
                a_e = a_s + len(answers[i]) if a_s >= 0 else 0
                a_s = max(a_s, 0)
                fitted = _fit_prompt(
                    tokenizer, contexts[i], a_s, a_e, len(p), prompt_fn(i),
                    seq_length - len(comp),
                )
                if fitted is None:
                    reason = "too_long"
                else:
                    p = fitted
        if not reason and not p:
            raise DataError(
                f"prompt_template {prompt_template!r} renders to no tokens; the first answer "
                "token needs a prompt token before it"
            )
        if reason:
            ids, labels = [], []
        else:
            ids = p + comp
            labels = [IGNORE_INDEX] * (len(p) - 1)
            labels += comp
            labels.append(IGNORE_INDEX)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["length"].append(len(ids))
        out["num_label_tokens"].append(len(comp) if ids else 0)
        out["drop_reason"].append(reason)
    return out


def _build_squad(
    path,
    tokenizer,
    seq_length: int | None = None,
    padding: str = "none",
    truncation: bool = True,
    split: str | None = None,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    completion_template: str = DEFAULT_COMPLETION_TEMPLATE,
    unanswerable_answer: str | None = None,
    on_bad_record: str = "raise",
    cache_dir=None,
    num_proc: int = 1,
    limit: int | None = None,
    trust_remote_code: bool = False,
    default_split: str | None = None,
) -> tuple:
    split = choose_split(path, split, default_split)
    tokenizer = as_tokenizer(tokenizer, trust_remote_code)
    check_padding(padding, seq_length)
    if seq_length is not None and seq_length < 2:
        raise ValueError(f"seq_length must be at least 2, got {seq_length}")
    if "{question}" not in prompt_template:
        raise ValueError(f"prompt_template must contain {{question}}: {prompt_template!r}")
    if "{answer}" not in completion_template:
        raise ValueError(f"completion_template must contain {{answer}}: {completion_template!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; SQuAD completions end with eos")

    key = {
        "seq_length": seq_length,
        "truncation": truncation,
        "prompt_template": prompt_template,
        "completion_template": completion_template,
        "unanswerable_answer": unanswerable_answer,
        "on_bad_record": on_bad_record,
        "limit": limit,
    }

    def build():
        rd = read_squad(path, split=split, on_bad_record=on_bad_record)
        cols = rd["columns"]
        skipped = Counter()
        if unanswerable_answer is None:
            keep = [i for i, s in enumerate(cols["answer_start"]) if s >= 0]
            skipped["unanswerable"] = len(cols["answer_start"]) - len(keep)
            if skipped["unanswerable"]:
                cols = {k: [v[i] for i in keep] for k, v in cols.items()}
        if limit is not None:
            cols = {k: v[:limit] for k, v in cols.items()}
        ds, drops = tokenize_records(
            cols,
            squad_tokenize_batch,
            dict(
                tokenizer=tokenizer,
                prompt_template=prompt_template,
                completion_template=completion_template,
                seq_length=seq_length,
                truncation=truncation,
                unanswerable_answer=unanswerable_answer,
            ),
            num_proc=num_proc,
            desc="tokenizing SQuAD",
        )
        dropped = Counter(rd["dropped"]) + drops
        stats = Stats(
            read=rd["read"],
            kept=len(ds),
            dropped=dict(dropped),
            skipped={k: v for k, v in skipped.items() if v},
            repaired=rd["repaired"],
        )
        return ds, stats

    return build_source("squad", path, split, tokenizer, seq_length, cache_dir, key, build)


class SquadDataset(SourceDataset):
    """Tokenized SQuAD examples (arguments: see the module docstring). For answer-quality
    metrics: :meth:`reference_answers` (every reference answer of each kept example's record)
    and :meth:`answer_of` (the answer in a generated completion)."""

    _build = staticmethod(_build_squad)

    def __init__(self, path, tokenizer, seq_length=None, padding="none", **kwargs):
        super().__init__(path, tokenizer, seq_length, padding, **kwargs)
        self._source = (path, kwargs.get("split"), kwargs.get("on_bad_record", "raise"))
        self._unanswerable = kwargs.get("unanswerable_answer")
        self._completion_template = kwargs.get("completion_template", DEFAULT_COMPLETION_TEMPLATE)

    def reference_answers(self) -> dict[str, list[str]]:
        """{record id: its reference answers} (read again from the source; an unanswerable
        question's answer is ``unanswerable_answer``)."""
        path, split, on_bad = self._source
        cols = read_squad(path, split=split, on_bad_record=on_bad)["columns"]
        return {i: (a or [self._unanswerable or ""]) for i, a in zip(cols["id"], cols["answers"])}

    def answer_of(self, completion: str) -> str:
        """The answer in a generated completion: the text of ``completion_template`` around
        ``{answer}`` removed where present."""
        head, _, tail = self._completion_template.partition("{answer}")
        text, head, tail = completion.strip(), head.strip(), tail.strip()
        if head and text.startswith(head):
            text = text[len(head):]
        if tail and text.endswith(tail):
            text = text[: -len(tail)]
        return text.strip()


@text_reader("squad")
def build_squad_dataset(path, tokenizer, **kwargs) -> SquadDataset:
    """``SquadDataset(path, tokenizer, **kwargs)``; the form a YAML ``_target_`` calls."""
    return SquadDataset(path, tokenizer, **kwargs)


build_squad_dataset.__signature__ = SquadDataset.__signature__  # exactly the arguments of _build_squad
