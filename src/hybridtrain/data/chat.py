"""Chat SFT data with loss on assistant turns only.

::

    build_chat_dataset(
        path,                 # .jsonl/.json/.parquet file, directory (+ split), glob, or a
                              # `datasets.Dataset`
        tokenizer,            # tokenizer object or local tokenizer directory
        seq_length=None,      # cut longer conversations at seq_length tokens
        padding="none",       # "none" | "max_length" (exactly seq_length)
        train_on="all",       # "all" assistant turns | "last" assistant turn only
        chat_template=None,   # a Jinja string that overrides the tokenizer's template
        chat_template_path=None,  # ... or a .jinja file holding it
        chat_template_kwargs=None,  # template variables, e.g. {"enable_thinking": False}
        mask_strategy="auto", # "auto" | "generation" | "placeholder" (see below)
        split=None, cache_dir=None, num_proc=1, limit=None,
        default_split=None,   # without `split`: the split a directory of several splits is
                              # read for (the recipe sets it: train / validation)
    ) -> TokenizedDataset
    ChatDataset = build_chat_dataset

Records are OpenAI style ``{"messages": [{"role", "content", ...}], "tools": [...]}`` (roles
system/user/assistant/tool; assistant ``reasoning_content`` and ``tool_calls``, whose
``arguments`` may be a JSON string or an object and reach the template as an object; ``content``
may be a list of text parts) or ShareGPT style ``{"conversations": [{"from": "human"|"gpt"|...,
"value": ...}], "system": "..."}``.

The tokens are exactly the tokenisation of the template's rendering of the *whole* conversation
(as ``tokenizer.apply_chat_template`` gives them, with ``tools`` and ``chat_template_kwargs``).
Supervised are the assistant turns as the template renders them -- content, reasoning where the
template keeps it, tool-call text -- and the end-of-turn token that closes each; never system,
user or tool text, never the assistant header (the generation prompt) nor the line break after
the end-of-turn token:

- ``generation``: the template's ``{% generation %}`` blocks, through
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``;
- ``placeholder``: any template, no prefix stability assumed: the turns are located in the
  whole rendering by rendering it again with placeholder text (``chat_masks.py``). An empty
  ``<think></think>`` a template writes before an answer is supervised unless it is part of
  the generation prompt (a prompt that ends ``<think>\n`` makes it part of the reply);
  reasoning a template drops from earlier turns is not in the rendering, so not supervised;
- ``auto``: ``generation`` when the template has the markers, else ``placeholder``.

Data problems: an assistant turn with empty content (no tool calls, no reasoning) is not trained
on (an empty answer teaches the model to say nothing) and counted in the one summary warning; a
conversation left without a supervised turn is dropped (``empty_assistant_content``). A
conversation without an assistant turn is an error (:class:`ChatFormatError`).

Labels are shifted (see ``dataset.py``). With ``seq_length``, a longer conversation is cut at
``seq_length`` tokens; if no supervised token is left it is dropped (counted, one warning).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridtrain.fileio import json_loads, read_text, text_reader

from .batch import IGNORE_INDEX
from .dataset import (
    SourceDataset,
    Stats,
    build_source,
    check_padding,
    shifted_labels,
    tokenize_records,
)
from .chat_masks import assistant_spans, end_of_turn
from .io import (
    ChatFormatError,
    MissingFieldError,
    choose_split,
    iter_records,
    record_name,
    require,
    resolve_data_files,
)
from .templates import apply_template, template_origin
from .tokenizer import as_tokenizer, template_has_generation_markers

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


def _tool_calls(calls: Any, where: str) -> list:
    """Assistant ``tool_calls`` with JSON-string ``arguments`` parsed into objects (templates
    iterate over them)."""
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}: 'tool_calls' must be a list")
    out = []
    for k, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise ChatFormatError(f"{where}: tool_calls[{k}] must be an object")
        call = dict(call)
        fn = dict(call["function"]) if isinstance(call.get("function"), Mapping) else call
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise ChatFormatError(f"{where}: tool_calls[{k}] has no function name; give "
                                  '{"function": {"name": ..., "arguments": {...}}}')
        args = fn.get("arguments")
        if isinstance(args, str) and args.strip().startswith("{"):
            try:
                fn["arguments"] = json_loads(args)
            except json.JSONDecodeError as e:
                raise ChatFormatError(
                    f"{where}: tool_calls[{k}] 'arguments' is a string but not valid JSON: {e}"
                ) from None
        if fn is not call:
            call["function"] = fn
        out.append(call)
    return out


def empty_assistant_turns(messages: list[dict]) -> list[int]:
    """Indices of the assistant messages with nothing to learn: blank content, no reasoning, no
    tool calls."""
    return [
        i for i, m in enumerate(messages)
        if m["role"] == "assistant" and not (m.get("content") or "").strip()
        and not (m.get("reasoning_content") or "").strip() and not m.get("tool_calls")
    ]


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
            for extra in ("reasoning_content", "name", "tool_call_id"):
                if m.get(extra) is not None:
                    msg[extra] = m[extra]
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], mwhere)
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
            tools = json_loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{name}: 'tools' is a string but not valid JSON: {e}") from None
    if tools is not None and not isinstance(tools, list):
        raise ChatFormatError(f"{name}: 'tools' must be a list of tool schemas")
    return messages, (tools or None)


def read_chat(source, split: str | None = None) -> dict:
    """``{"columns": {"messages_json", "tools_json", "skip_json", "where"}, "read": n}``;
    ``skip_json`` lists the empty assistant turns (:func:`empty_assistant_turns`)."""
    cols: dict[str, list] = {"messages_json": [], "tools_json": [], "skip_json": [], "where": []}

    def add(rec, where):
        messages, tools = normalize_conversation(rec, where)
        cols["messages_json"].append(json.dumps(messages, ensure_ascii=False))
        cols["tools_json"].append(json.dumps(tools, ensure_ascii=False) if tools else "")
        cols["skip_json"].append(json.dumps(empty_assistant_turns(messages)))
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


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of ones."""
    runs, t = [], 0
    while t < len(mask):
        if mask[t]:
            u = t
            while u < len(mask) and mask[u]:
                u += 1
            runs.append((t, u))
            t = u
        else:
            t += 1
    return runs


def _keep_runs(mask: list[int], keep: list[bool]) -> list[int]:
    """``mask`` with only the runs of ones marked True in ``keep`` (one flag per run)."""
    out = [0] * len(mask)
    for (s, e), k in zip(_runs(mask), keep):
        if k:
            out[s:e] = [1] * (e - s)
    return out


def _turn_selection(messages, skip, train_on) -> list[bool]:
    """Per assistant message: is it trained on."""
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [i not in skip and (train_on == "all" or i == idx[-1]) for i in idx]


def assistant_mask_generation(tokenizer, messages, tools, chat_template, train_on="all",
                              skip=(), template_kwargs=None, where="", origin=None):
    """``(input_ids, mask)`` from the template's ``{% generation %}`` blocks."""
    out = apply_template(
        tokenizer,
        messages,
        where,
        origin,
        tools=tools,
        chat_template=chat_template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **(template_kwargs or {}),
    )
    ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    turns = _turn_selection(messages, set(skip), train_on)
    n_runs = len(_runs(mask))
    if all(turns):
        return ids, mask
    if n_runs == len(turns):  # one run per assistant turn
        return ids, _keep_runs(mask, turns)
    if train_on == "last" and not skip:
        return ids, _keep_runs(mask, [k == n_runs - 1 for k in range(n_runs)])
    raise ChatFormatError(
        f"{where}: the {{% generation %}} blocks of the chat template do not mark one span per "
        "assistant turn, so an empty answer cannot be left out; use mask_strategy: placeholder"
    )


def chat_renderer(tokenizer, tools, chat_template, template_kwargs=None, where="", origin=None):
    """``render(messages, add_generation_prompt) -> str`` with the template and its options
    (its errors name ``origin`` and the record ``where``: :func:`apply_template`)."""

    def render(messages, add_generation_prompt):
        return apply_template(
            tokenizer, messages, where, origin, tools=tools, chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt, **(template_kwargs or {}),
        )

    return render


def added_token_strings(tokenizer) -> list[str]:
    """The tokenizer's added (special) tokens as strings, e.g. ``<think>``."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted({str(t) for t in decoder.values()} | set(tokenizer.all_special_tokens))


def assistant_mask_placeholder(tokenizer, messages, tools, chat_template, train_on="all",
                               skip=(), template_kwargs=None, where="", origin=None, eot=None):
    """``(input_ids, mask)`` for any template: assistant spans of the whole rendering
    (``chat_masks.assistant_spans``) mapped to the tokens by character offsets; a token that
    overlaps a span is supervised (``" Hi"`` after a header that ends ``[/INST]``)."""
    render = chat_renderer(tokenizer, tools, chat_template, template_kwargs, where, origin)
    text, spans = assistant_spans(
        render, messages, where, keep=added_token_strings(tokenizer), skip=skip, eot=eot
    )
    turns = _turn_selection(messages, set(skip), train_on)
    spans = [sp for turn, keep in zip(spans, turns) if keep for sp in turn]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    k = 0
    for t, (s, e) in enumerate(enc["offset_mapping"]):  # a token that overlaps a span
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k < len(spans) and s < spans[k][1] and e > spans[k][0]:
            mask[t] = 1
    return ids, mask


def chat_tokenize_batch(
    batch: dict[str, list],
    tokenizer,
    chat_template: str,
    strategy: str,
    train_on: str,
    seq_length: int | None,
    template_kwargs: dict | None = None,
    origin: str | None = None,
) -> dict[str, list]:
    """``datasets.map`` function: serialized conversations -> tokenized examples."""
    out: dict[str, list] = {
        k: [] for k in ("input_ids", "labels", "length", "num_label_tokens", "drop_reason")
    }
    out["id"] = list(batch["where"])
    eot = None
    if strategy == "placeholder":
        eot = end_of_turn(chat_renderer(tokenizer, None, chat_template, template_kwargs,
                                        origin=origin), added_token_strings(tokenizer))
    rows = zip(batch["messages_json"], batch["tools_json"], batch["skip_json"], batch["where"])
    for mj, tj, sj, where in rows:
        messages = json.loads(mj)
        tools = json.loads(tj) if tj else None
        skip = json.loads(sj)
        if not any(_turn_selection(messages, set(skip), train_on)):
            for k, v in (("input_ids", []), ("labels", []), ("length", 0),
                         ("num_label_tokens", 0), ("drop_reason", "empty_assistant_content")):
                out[k].append(v)
            continue
        args = (tokenizer, messages, tools, chat_template, train_on, skip, template_kwargs, where,
                origin)
        if strategy == "generation":
            ids, mask = assistant_mask_generation(*args)
        else:
            ids, mask = assistant_mask_placeholder(*args, eot=eot)
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


@text_reader("chat template", arg="chat_template_path")
def resolve_template(tokenizer, chat_template: str | None, chat_template_path) -> str:
    """The chat template to use: ``chat_template``, the file ``chat_template_path``, or the
    tokenizer's own (its default one when it has several)."""
    if chat_template and chat_template_path:
        raise ValueError(
            "dataset: give chat_template or chat_template_path, not both"
        )
    if chat_template_path:
        path = Path(os.path.expanduser(str(chat_template_path)))
        if not path.is_file():
            raise ValueError(f"dataset.chat_template_path: {str(path)!r} is not a file")
        chat_template = read_text(path)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates: use the default one
        template = template.get("default")
    if not template:
        raise ValueError(
            "the tokenizer has no chat template; set dataset.chat_template_path (a .jinja file) "
            "or dataset.chat_template (a Jinja string)"
        )
    return template


def _build_chat(
    path,
    tokenizer,
    seq_length: int | None = None,
    padding: str = "none",
    train_on: str = "all",
    chat_template: str | None = None,
    chat_template_path: str | None = None,
    chat_template_kwargs: Mapping | None = None,
    mask_strategy: str = "auto",
    split: str | None = None,
    cache_dir=None,
    num_proc: int = 1,
    limit: int | None = None,
    trust_remote_code: bool = False,
    default_split: str | None = None,
) -> tuple:
    split = choose_split(path, split, default_split)
    tokenizer = as_tokenizer(tokenizer, trust_remote_code)
    if train_on not in ("all", "last"):
        raise ValueError(f"train_on must be 'all' or 'last', got {train_on!r}")
    check_padding(padding, seq_length)
    if mask_strategy not in ("auto", "generation", "placeholder"):
        raise ValueError(
            "mask_strategy must be 'auto', 'generation' or 'placeholder', got "
            f"{mask_strategy!r}"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise ValueError(
            "dataset.chat_template_kwargs must be a mapping of template variables, e.g. "
            f"{{enable_thinking: false}}; got {type(chat_template_kwargs).__name__}"
        )
    template_kwargs = dict(chat_template_kwargs or {})
    template = resolve_template(tokenizer, chat_template, chat_template_path)
    has_markers = template_has_generation_markers(template)
    strategy = mask_strategy
    if strategy == "auto":
        strategy = "generation" if has_markers else "placeholder"
    if strategy == "generation" and not has_markers:
        raise ValueError(
            "mask_strategy='generation' needs {% generation %} markers in the chat template"
        )
    if strategy == "placeholder" and not getattr(tokenizer, "is_fast", False):
        raise ValueError("mask_strategy='placeholder' needs a fast tokenizer (character offsets)")

    key = {
        "template": template,
        "template_kwargs": template_kwargs,
        "strategy": strategy,
        "masks": 2,  # how turns are selected (empty answers are not trained on)
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
                template_kwargs=template_kwargs,
                origin=template_origin(tokenizer, chat_template, chat_template_path),
            ),
            num_proc=num_proc,
            desc="tokenizing chat",
            batch_size=256,
        )
        empty = sum(len(json.loads(s)) for s in cols["skip_json"])
        stats = Stats(read=rd["read"], kept=len(ds), dropped=dict(Counter(drops)),
                      skipped={}, turns_skipped={"empty_assistant_content": empty})
        return ds, stats

    return build_source("chat", path, split, tokenizer, seq_length, cache_dir, key, build)


class ChatDataset(SourceDataset):
    """Tokenized chat examples with assistant-only labels (arguments: see the module docstring)."""

    _build = staticmethod(_build_chat)


@text_reader("chat")
def build_chat_dataset(path, tokenizer, **kwargs) -> ChatDataset:
    """``ChatDataset(path, tokenizer, **kwargs)``; the form a YAML ``_target_`` calls."""
    return ChatDataset(path, tokenizer, **kwargs)


build_chat_dataset.__signature__ = ChatDataset.__signature__  # exactly the arguments of _build_chat
