"""Chat SFT data with loss on assistant turns only.

::

    build_chat_dataset(
        path,                 # .jsonl/.json/.parquet file, directory (+ split), glob, or a
                              # `datasets.Dataset`
        tokenizer,            # tokenizer object or local tokenizer directory
        seq_length=None,      # cut longer conversations at seq_length tokens
        padding="none",       # "none" | "max_length" (exactly seq_length)
        train_on="all",       # "all" assistant turns | "last" assistant turn only
        chat_template=None,   # override the tokenizer's template
        mask_strategy="auto", # "auto" | "generation" | "prefix" (see below)
        split=None, cache_dir=None, num_proc=1, limit=None,
    ) -> TokenizedDataset
    ChatDataset = build_chat_dataset

Records are OpenAI style ``{"messages": [{"role", "content", ...}], "tools": [...]}`` (roles
system/user/assistant/tool; assistant ``tool_calls``; ``content`` may be a list of text parts) or
ShareGPT style ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": ...}],
"system": "..."}``.

The conversation is rendered with the chat template and tokenized exactly as
``tokenizer.apply_chat_template`` does. Supervised tokens are the assistant content and its
end-of-turn token, never the assistant header:

- ``generation``: the template's ``{% generation %}`` blocks, through
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``;
- ``prefix``: for each assistant turn ``i``, render ``messages[:i]`` with the generation prompt
  and ``messages[:i+1]``; the supervised characters are the difference (without the trailing
  whitespace after the end-of-turn token). Needs a prefix-stable template.
- ``auto``: ``generation`` when the template has the markers, else ``prefix``.

Labels are shifted (see ``dataset.py``). With ``seq_length``, a longer conversation is cut at
``seq_length`` tokens; if no supervised token is left it is dropped (counted, one warning).
A conversation without an assistant turn is an error (:class:`ChatFormatError`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

from .batch import IGNORE_INDEX
from .dataset import (
    SourceDataset,
    Stats,
    build_cached,
    check_padding,
    report,
    shifted_labels,
    source_key,
    tokenize_records,
)
from .io import (
    ChatFormatError,
    MissingFieldError,
    iter_records,
    record_name,
    require,
    resolve_data_files,
)
from .tokenizer import as_tokenizer, template_has_generation_markers, tokenizer_fingerprint

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
ROLES = ("system", "user", "assistant", "tool")


def _content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        texts = []
        for k, part in enumerate(value):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatFormatError(
                    f"{where}: content part {k} has type {kind!r}; text chat data takes only "
                    "text parts"
                )
        return "".join(texts)
    raise ChatFormatError(f"{where}: 'content' must be a string, got {type(value).__name__}")


def normalize_conversation(rec: Mapping, where: str) -> tuple[list[dict], list | None]:
    """``(messages, tools)`` in OpenAI form from an OpenAI or ShareGPT record."""
    name = record_name(where, rec)
    if not isinstance(rec, Mapping):
        raise ChatFormatError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    messages: list[dict] = []
    if "messages" in rec and rec["messages"] is not None:
        raw = rec["messages"]
        if not isinstance(raw, list):
            raise ChatFormatError(f"{name}: 'messages' must be a list")
        for k, m in enumerate(raw):
            mwhere = f"{name} messages[{k}]"
            role = require(m, "role", mwhere)
            if role not in ROLES:
                raise ChatFormatError(
                    f"{mwhere}: unknown role {role!r}; expected one of {', '.join(ROLES)}"
                )
            msg = {"role": role}
            content = _content(m.get("content"), mwhere)
            if content is None and not (role == "assistant" and m.get("tool_calls")):
                raise MissingFieldError("content", mwhere)
            msg["content"] = content
            for extra in ("tool_calls", "name", "tool_call_id"):
                if m.get(extra) is not None:
                    msg[extra] = m[extra]
            messages.append(msg)
    elif "conversations" in rec and rec["conversations"] is not None:
        raw = rec["conversations"]
        if not isinstance(raw, list):
            raise ChatFormatError(f"{name}: 'conversations' must be a list")
        if rec.get("system"):
            messages.append({"role": "system", "content": str(rec["system"])})
        for k, m in enumerate(raw):
            mwhere = f"{name} conversations[{k}]"
            frm = require(m, "from", mwhere)
            role = SHAREGPT_ROLES.get(str(frm).lower())
            if role is None:
                raise ChatFormatError(
                    f"{mwhere}: unknown speaker 'from': {frm!r}; expected one of "
                    f"{', '.join(SHAREGPT_ROLES)}"
                )
            messages.append({"role": role, "content": _content(require(m, "value", mwhere), mwhere)})
    else:
        raise MissingFieldError(
            "messages", name, "chat records need 'messages' (OpenAI) or 'conversations' (ShareGPT)"
        )
    if not messages:
        raise ChatFormatError(f"{name}: the conversation is empty")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatFormatError(
            f"{name}: the conversation has no assistant turn, so there is nothing to train on; "
            "remove it or add the assistant reply"
        )
    tools = rec.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{name}: 'tools' is a string but not valid JSON: {e}") from None
    if tools is not None and not isinstance(tools, list):
        raise ChatFormatError(f"{name}: 'tools' must be a list of tool schemas")
    return messages, (tools or None)


def read_chat(source, split: str | None = None) -> dict:
    """``{"columns": {"messages_json": [...], "tools_json": [...], "where": [...]}, "read": n}``."""
    cols: dict[str, list] = {"messages_json": [], "tools_json": [], "where": []}

    def add(rec, where):
        messages, tools = normalize_conversation(rec, where)
        cols["messages_json"].append(json.dumps(messages, ensure_ascii=False))
        cols["tools_json"].append(json.dumps(tools, ensure_ascii=False) if tools else "")
        cols["where"].append(record_name(where, rec))

    if hasattr(source, "column_names") and hasattr(source, "__iter__"):
        for i, rec in enumerate(source):
            add(rec, f"dataset row {i}")
    else:
        for f in resolve_data_files(source, split):
            for where, rec in iter_records(f):
                add(rec, where)
    return {"columns": cols, "read": len(cols["where"])}


# --------------------------------------------------------------------------- masks


def _last_run(mask: list[int]) -> list[int]:
    out = [0] * len(mask)
    t = len(mask) - 1
    while t >= 0 and not mask[t]:
        t -= 1
    while t >= 0 and mask[t]:
        out[t] = 1
        t -= 1
    return out


def assistant_mask_generation(tokenizer, messages, tools, chat_template, train_on="all"):
    """``(input_ids, mask)`` from the template's ``{% generation %}`` blocks."""
    out = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=chat_template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    if train_on == "last":
        mask = _last_run(mask)
    return ids, mask


def assistant_spans_prefix(tokenizer, messages, tools, chat_template, where=""):
    """``(full_text, [(start, end), ...])``: assistant character spans by prefix differences."""

    def render(msgs, gen):
        return tokenizer.apply_chat_template(
            msgs, tools=tools, chat_template=chat_template, tokenize=False,
            add_generation_prompt=gen,
        )

    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise ChatFormatError(
                f"{where}: the conversation starts with an assistant turn; finding its header by "
                "prefix rendering needs a turn before it -- use a template with "
                "{% generation %} markers"
            )
        before = render(messages[:i], True)
        upto = render(messages[: i + 1], False)
        if not upto.startswith(before) or not full.startswith(upto):
            raise ChatFormatError(
                f"{where}: the chat template is not prefix-stable (rendering the first {i} "
                "messages is not a prefix of the whole conversation), so assistant tokens cannot "
                "be found by prefix differences; add {% generation %} ... {% endgeneration %} "
                "around the assistant content in the template"
            )
        end = len(upto.rstrip())
        spans.append((len(before), max(len(before), end)))
    return full, spans


def assistant_mask_prefix(tokenizer, messages, tools, chat_template, train_on="all", where=""):
    """``(input_ids, mask)`` from prefix differences (for templates without generation markers)."""
    full, spans = assistant_spans_prefix(tokenizer, messages, tools, chat_template, where)
    if train_on == "last":
        spans = spans[-1:]
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    k = 0
    for t, (s, _e) in enumerate(enc["offset_mapping"]):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k < len(spans) and spans[k][0] <= s < spans[k][1]:
            mask[t] = 1
    return ids, mask


def chat_tokenize_batch(
    batch: dict[str, list],
    tokenizer,
    chat_template: str,
    strategy: str,
    train_on: str,
    seq_length: int | None,
) -> dict[str, list]:
    """``datasets.map`` function: serialized conversations -> tokenized examples."""
    out: dict[str, list] = {
        k: [] for k in ("input_ids", "labels", "length", "num_label_tokens", "drop_reason")
    }
    out["id"] = list(batch["where"])
    for mj, tj, where in zip(batch["messages_json"], batch["tools_json"], batch["where"]):
        messages = json.loads(mj)
        tools = json.loads(tj) if tj else None
        if strategy == "generation":
            ids, mask = assistant_mask_generation(tokenizer, messages, tools, chat_template, train_on)
        else:
            ids, mask = assistant_mask_prefix(
                tokenizer, messages, tools, chat_template, train_on, where
            )
        cut = seq_length is not None and len(ids) > seq_length
        if cut:
            ids, mask = ids[:seq_length], mask[:seq_length]
        labels = shifted_labels(ids, [bool(m) for m in mask])
        n_lab = sum(1 for x in labels if x != IGNORE_INDEX)
        reason = ""
        if n_lab == 0:
            reason = "no_supervised_tokens_after_truncation" if cut else "no_supervised_tokens"
            ids, labels = [], []
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["length"].append(len(ids))
        out["num_label_tokens"].append(n_lab)
        out["drop_reason"].append(reason)
    return out


def _build_chat(
    path,
    tokenizer,
    seq_length: int | None = None,
    padding: str = "none",
    train_on: str = "all",
    chat_template: str | None = None,
    mask_strategy: str = "auto",
    split: str | None = None,
    cache_dir=None,
    num_proc: int = 1,
    limit: int | None = None,
    trust_remote_code: bool = False,
) -> tuple:
    tokenizer = as_tokenizer(tokenizer, trust_remote_code)
    if train_on not in ("all", "last"):
        raise ValueError(f"train_on must be 'all' or 'last', got {train_on!r}")
    check_padding(padding, seq_length)
    if mask_strategy not in ("auto", "generation", "prefix"):
        raise ValueError(
            f"mask_strategy must be 'auto', 'generation' or 'prefix', got {mask_strategy!r}"
        )
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates: use the default one
        template = template.get("default")
    if not template:
        raise ValueError(
            "the tokenizer has no chat template; pass chat_template=... (a Jinja string)"
        )
    has_markers = template_has_generation_markers(template)
    strategy = mask_strategy
    if strategy == "auto":
        strategy = "generation" if has_markers else "prefix"
    if strategy == "generation" and not has_markers:
        raise ValueError(
            "mask_strategy='generation' needs {% generation %} markers in the chat template"
        )
    if strategy == "prefix" and not getattr(tokenizer, "is_fast", False):
        raise ValueError("mask_strategy='prefix' needs a fast tokenizer (character offsets)")
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token (load_tokenizer sets pad = eos)")

    source, src_key = source_key(path, split)
    key = {
        "source": src_key,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": template,
        "strategy": strategy,
        "train_on": train_on,
        "seq_length": seq_length,
        "limit": limit,
    }

    def build():
        rd = read_chat(path, split=split)
        cols = rd["columns"]
        if limit is not None:
            cols = {k: v[:limit] for k, v in cols.items()}
        ds, drops = tokenize_records(
            cols,
            chat_tokenize_batch,
            dict(
                tokenizer=tokenizer,
                chat_template=template,
                strategy=strategy,
                train_on=train_on,
                seq_length=seq_length,
            ),
            num_proc=num_proc,
            desc="tokenizing chat",
            batch_size=256,
        )
        stats = Stats(read=rd["read"], kept=len(ds), dropped=dict(Counter(drops)), skipped={})
        return ds, stats

    ds, stats, cache_path = build_cached("chat", key, cache_dir, build)
    report(stats, source, seq_length)
    return ds, stats, cache_path, tokenizer.pad_token_id


class ChatDataset(SourceDataset):
    """Tokenized chat examples with assistant-only labels (arguments: see the module docstring)."""

    _build = staticmethod(_build_chat)


def build_chat_dataset(path, tokenizer, **kwargs) -> ChatDataset:
    """``ChatDataset(path, tokenizer, **kwargs)``; the form a YAML ``_target_`` calls."""
    return ChatDataset(path, tokenizer, **kwargs)


build_chat_dataset.__signature__ = ChatDataset.__signature__  # exactly the arguments of _build_chat
