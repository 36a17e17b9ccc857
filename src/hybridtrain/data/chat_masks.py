"""Assistant spans in a chat template's rendering of a whole conversation, for any template.

::

    assistant_spans(render, messages, where, keep=(), skip=()) -> (text, [[(start, end), ...], ...])

``render(messages, add_generation_prompt) -> str`` renders with the chat template (and its
options). ``text`` is ``render(messages, False)``: the whole conversation as the model sees it at
inference. ``spans[k]`` are the ``[start, end)`` characters of ``text`` the ``k``-th assistant
turn (in message order) emits itself: from the end of its header to the end of its end-of-turn
marker (several spans when the template writes the reply as several blocks, each with a header,
e.g. text then tool calls: the headers between them are not part of the reply).

How, without template-specific code and without assuming that rendering a prefix of the
conversation gives a prefix of the text:

1. Every assistant message's own text (``content``, ``reasoning_content``, tool-call names) is
   replaced by numbered placeholders, one per run of ordinary characters; the strings in ``keep``
   (the tokenizer's added tokens, e.g. ``<think>``) and the whitespace at the edges of each run
   stay, so the template's own tests (``'</think>' in content``, ``| trim``) take the same
   branches.
   The placeholder rendering must give back the real rendering exactly once each placeholder is
   replaced by its text (the structural check); each placeholder may appear at most once.
2. Within that rendering, a turn starts after its header: the generation prompt (what
   ``add_generation_prompt`` appends before the model speaks), or when the turn does not start
   with the whole prompt (``<think></think>`` where the prompt opens ``<think>\\n``) the prompt's
   longest common part cut back to its last line break. So an empty ``<think></think>`` the
   template writes is supervised unless it is part of the generation prompt. A template without
   a generation prompt (or none that heads the turn) starts the reply at its own text.
3. A turn ends with the first end-of-turn marker after its last placeholder: the first of the
   ``keep`` tokens (else the first word) the template writes after an assistant reply at the end
   of a conversation (``<|im_end|>``, ``<|eot_id|>``); the line break after it is not part of the
   span.

A turn of which nothing shows in the rendering (the template drops it, e.g. earlier reasoning-only
turns) and the turns in ``skip`` get no span (``[]``). Anything ambiguous raises
:class:`ChatFormatError` naming ``where`` and the turn.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterable, Sequence

from .io import ChatFormatError

OPEN, CLOSE = "\ue000", "\ue001"  # private-use code points: no tokenizer or text uses them
_PLACEHOLDER = re.compile(OPEN + r"(\d+)" + CLOSE)
_EDGES = re.compile(r"(\s*)(.*?)(\s*)", re.S)

Render = Callable[[list, bool], str]


def _with_placeholders(text: str, keep_re: re.Pattern | None, values: list[str]) -> str:
    """``text`` with each run of ordinary characters replaced by a placeholder (appended to
    ``values``); kept strings and the whitespace at the edges of runs stay."""
    pieces = keep_re.split(text) if keep_re is not None else [text]
    out = []
    for k, piece in enumerate(pieces):
        if k % 2:  # a kept string (the split pattern has one group)
            out.append(piece)
            continue
        lead, body, trail = _EDGES.fullmatch(piece).groups()
        if body:
            out.append(f"{lead}{OPEN}{len(values)}{CLOSE}{trail}")
            values.append(body)
        else:
            out.append(piece)
    return "".join(out)


def _keep_pattern(keep: Iterable[str]) -> re.Pattern | None:
    keep = sorted({k for k in keep if k and not k.isspace()}, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, keep)) + ")") if keep else None


def placeholder_messages(messages: Sequence[dict], keep: Iterable[str] = ()):
    """``(messages with placeholders, values, owner)``: ``values[k]`` is the text of placeholder
    ``k`` and ``owner[k]`` the index of its message."""
    keep_re = _keep_pattern(keep)
    values: list[str] = []
    owner: list[int] = []
    out = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            out.append(m)
            continue
        n0 = len(values)
        m = dict(m)
        for field in ("reasoning_content", "content"):
            if isinstance(m.get(field), str):
                m[field] = _with_placeholders(m[field], keep_re, values)
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                fn = dict(call["function"]) if isinstance(call.get("function"), dict) else call
                if isinstance(fn.get("name"), str):
                    fn["name"] = _with_placeholders(fn["name"], None, values)
                if fn is not call:
                    call["function"] = fn
                calls.append(call)
            m["tool_calls"] = calls
        owner.extend([i] * (len(values) - n0))
        out.append(m)
    return out, values, owner


def _generation_prompt(render: Render, messages: Sequence[dict], i: int) -> str:
    """What ``add_generation_prompt`` appends after ``messages[:i]`` (after one user message
    when that rendering fails or is not an extension)."""
    for head in ([*messages[:i]] if i else None, [{"role": "user", "content": "?"}]):
        if not head:
            continue
        try:
            a, b = render(head, False), render(head, True)
        except Exception:  # a template may reject a partial conversation
            continue
        if b.startswith(a) and len(b) > len(a):
            return b[len(a):]
    return ""


def end_of_turn(render: Render, keep: Iterable[str] = ()) -> str:
    """The marker that closes an assistant reply, from what the template writes after the reply
    of a one-turn conversation: its first token of ``keep`` (``<|im_end|>``, ``<|eot_id|>``), else
    its first word; ``""`` if it writes nothing."""
    ph = f"{OPEN}0{CLOSE}"
    text = render([{"role": "user", "content": "?"}, {"role": "assistant", "content": ph}], False)
    tail = text.split(ph, 1)[-1] if text.count(ph) == 1 else ""
    keep_re = _keep_pattern(keep)
    m = keep_re.search(tail) if keep_re is not None else None
    if m:
        return m.group(0)
    words = tail.split()
    return words[0] if words else ""


def _header(prompt: str, window: str) -> str:
    """The part of the generation prompt that heads the turn ending ``window``: all of it, or
    its longest part found there cut back to a line break; ``""`` if neither."""
    if prompt in window:
        return prompt
    k = len(prompt)
    while k > 0 and prompt[:k] not in window:
        k -= 1
    return prompt[: prompt.rfind("\n", 0, k) + 1]


def _turn(where: str, i: int) -> str:
    return f"{where} messages[{i}] (assistant)"


def assistant_spans(
    render: Render,
    messages: Sequence[dict],
    where: str = "",
    keep: Iterable[str] = (),
    skip: Iterable[int] = (),
    eot: str | None = None,
) -> tuple[str, list[list[tuple[int, int]]]]:
    """``(text, spans)``: the spans of each assistant message (``[]`` for none); see the module
    docstring."""
    text = render(list(messages), False)
    ph_messages, values, owner = placeholder_messages(messages, keep)
    if any(OPEN in v or CLOSE in v for v in values) or OPEN in text or CLOSE in text:
        raise ChatFormatError(
            f"{where}: the text contains the private-use characters U+E000/U+E001, which mark "
            "placeholders; remove them from the data"
        )
    sk = render(ph_messages, False)
    found = list(_PLACEHOLDER.finditer(sk))
    ids = [int(m.group(1)) for m in found]
    dup = next((k for k in ids if ids.count(k) > 1), None)
    if dup is not None or sk.count(OPEN) != len(found) or sk.count(CLOSE) != len(found):
        i = owner[dup] if dup is not None else owner[0]
        what = "more than once" if dup is not None else "altered (cut or transformed)"
        raise ChatFormatError(
            f"{_turn(where, i)}: the chat template renders the assistant text {what}, so its "
            "tokens cannot be located unambiguously; add {% generation %} ... "
            "{% endgeneration %} around the assistant reply in the template"
        )
    # structural check: the placeholder rendering with each placeholder's text is the rendering
    s_ends, shifts, r_starts, parts, pos, shift = [], [], [], [], 0, 0
    for m, k in zip(found, ids):
        r_starts.append(m.start() + shift)
        parts += [sk[pos : m.start()], values[k]]
        shift += len(values[k]) - (m.end() - m.start())
        s_ends.append(m.end())
        shifts.append(shift)
        pos = m.end()
    parts.append(sk[pos:])
    rebuilt = "".join(parts)
    if rebuilt != text:
        r = next((c for c, (x, y) in enumerate(zip(rebuilt, text)) if x != y),
                 min(len(rebuilt), len(text)))
        j = max(0, bisect.bisect_right(r_starts, r) - 1)
        i = owner[ids[j]] if ids else next(
            n for n, m in enumerate(messages) if m.get("role") == "assistant")
        raise ChatFormatError(
            f"{_turn(where, i)}: the chat template renders this conversation with a different "
            f"structure than with placeholder text (first difference at character {r}: "
            f"{text[max(0, r - 20):r + 20]!r}), so assistant tokens cannot be located; add "
            "{% generation %} ... {% endgeneration %} around the assistant reply in the template"
        )

    def to_text(p: int) -> int:  # a position of `sk` outside placeholders -> one of `text`
        j = bisect.bisect_right(s_ends, p)
        return p + (shifts[j - 1] if j else 0)

    eot = end_of_turn(render, keep) if eot is None else eot
    first, last = {}, {}
    for m, k in zip(found, ids):
        i = owner[k]
        first.setdefault(i, m.start())
        last[i] = m.end()
    skip = set(skip)
    spans: list[list[tuple[int, int]]] = []
    prev_end = 0
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        if i in skip or i not in first:
            spans.append([])
            continue
        window = sk[prev_end : first[i]]
        prompt = _generation_prompt(render, messages, i)
        head = _header(prompt, window)
        # without a generation prompt that heads it, the reply starts at its own text
        start = prev_end + window.rfind(head) + len(head) if head else first[i]
        e = sk.find(eot, last[i]) if eot else -1
        nxt = min((first[j] for j in first if j > i), default=len(sk))
        if e < 0 or e >= nxt:
            raise ChatFormatError(
                f"{_turn(where, i)}: no end-of-turn marker ({eot!r}) follows this assistant "
                "turn in the rendering; add {% generation %} ... {% endgeneration %} around the "
                "assistant reply in the template"
            )
        prev_end = e + len(eot)
        spans.append([(to_text(a), to_text(b)) for a, b in _blocks(sk, start, prev_end, eot,
                                                                     prompt)])
    return text, spans


def _blocks(sk: str, start: int, end: int, eot: str, prompt: str) -> list[tuple[int, int]]:
    """``[start, end)`` split where the template closes the turn and opens it again with a
    header (a reply written as several blocks, e.g. its text, then its tool calls)."""
    out, pos = [], start
    e = sk.find(eot, pos, end - len(eot))
    while e >= 0:
        after = e + len(eot)
        at = after + len(sk[after:end]) - len(sk[after:end].lstrip())
        k = 0
        while k < len(prompt) and at + k < end and sk[at + k] == prompt[k]:
            k += 1
        head = k if k == len(prompt) else prompt[:k].rfind("\n") + 1
        if head and prompt[:head].strip():
            out.append((pos, after))
            pos = at + head
        e = sk.find(eot, after, end - len(eot))
    out.append((pos, end))
    return out
