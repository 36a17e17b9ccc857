"""Assistant masks on the model families' own chat templates, token by token.

Each template has an oracle written here from reading the template: the conversation as a list
of ``(text, supervised)`` pieces. The dataset's tokens must be the pieces' tokens (each piece
ends at a special token or a line break, so tokenizing piece by piece gives the whole text's
tokens) and its labels exactly the supervised pieces' tokens. Supervised: the assistant turn as
rendered after its header (the generation prompt, or its part up to a line break) through its
end-of-turn token; never the line break after it.
"""

from __future__ import annotations

import json

import pytest

from hybridtrain.data import CHATML_TEMPLATE, CHATML_TEMPLATE_NO_GENERATION, build_chat_dataset
from tests.helpers.data import (
    NEMOTRON3_NANO_TEMPLATE,
    NEMOTRON_NANO_9B_V2_TEMPLATE,
    chat_tokenizer,
    require_shared,
)


@pytest.fixture(scope="module")
def ctok(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory)


# ------------------------------------------------------------------------- conversations
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS = {
    "single": {"messages": [
        {"role": "user", "content": "Who ruled Normandy?"},
        {"role": "assistant", "content": "Rollo, in 911."}]},
    "multi": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Who ruled Normandy?"},
        {"role": "assistant", "content": "Rollo, in 911."},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "His descendants, the dukes."}]},
    "reasoning": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Add two and two.", "content": "4"},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "reasoning_content": "4 times 3 is 12.", "content": "12"}]},
    "tools": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny, 21C"},
        {"role": "assistant", "content": "It is sunny."}]},
    "tool_call_last": {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]}]},
}


class Pieces(list):
    def add(self, text, sup=False):
        if text:
            self.append((text, bool(sup)))


def assistant_indices(messages):
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def trained(messages, i, train_on):
    return train_on == "all" or i == assistant_indices(messages)[-1]


# ------------------------------------------------------------------------- oracles
def oracle_chatml(messages, tools, train_on, kwargs):
    """ChatML (tokenizer.CHATML_TEMPLATE, with or without markers); no reasoning."""
    p = Pieces()
    if tools:
        p.add("<|im_start|>system\nYou may call these tools:\n"
              + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools) + "<|im_end|>\n")
    for i, m in enumerate(messages):
        p.add("<|im_start|>" + m["role"] + "\n")
        if m["role"] != "assistant":
            p.add(m["content"] + "<|im_end|>\n")
            continue
        body = m["content"] or ""
        for c in m.get("tool_calls") or []:
            body += "<tool_call>" + json.dumps({"name": c["function"]["name"],
                                                "arguments": c["function"]["arguments"]})
            body += "</tool_call>"
        p.add(body + "<|im_end|>", trained(messages, i, train_on))
        p.add("\n")
    return p


def oracle_llama3(messages, tools, train_on, kwargs):
    p = Pieces()
    p.add("<|begin_of_text|>")
    for i, m in enumerate(messages):
        role = "ipython" if m["role"] == "tool" else m["role"]
        p.add("<|start_header_id|>" + role + "<|end_header_id|>\n\n")
        body = (m["content"] or "").strip()
        for c in m.get("tool_calls") or []:
            body += json.dumps({"name": c["function"]["name"],
                                "parameters": c["function"]["arguments"]})
        p.add(body + "<|eot_id|>", m["role"] == "assistant" and trained(messages, i, train_on))
    return p


LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for m in messages %}"
    "{%- set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{{- (m['content'] or '') | trim }}"
    "{%- for c in m['tool_calls'] or [] %}"
    "{{- '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' }}"
    "{{- c['function']['arguments'] | tojson }}{{- '}' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def oracle_nemotron3(messages, tools, train_on, kwargs):
    """Nemotron 3 Nano: system block always; `<think></think>` before answers without reasoning;
    reasoning of turns before the last user turn dropped (truncate_history_thinking); tool
    results in one user block. Generation prompt `<|im_start|>assistant\\n<think>\\n` (or
    `...<think></think>` with enable_thinking=False): the part of it a turn starts with is the
    header."""
    think = kwargs.get("enable_thinking", True)
    truncate = kwargs.get("truncate_history_thinking", True)
    p = Pieces()
    msgs = list(messages)
    system = ""
    if msgs[0]["role"] == "system":
        system, msgs = msgs[0]["content"], msgs[1:]
    offset = len(messages) - len(msgs)
    if tools:  # the tool list: taken from the real rendering in the test (not supervised)
        p.add("<TOOLS-BLOCK>")
    else:
        p.add("<|im_start|>system\n" + system + "<|im_end|>\n")
    last_user = max((k for k, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    for k, m in enumerate(msgs):
        sup = m["role"] == "assistant" and trained(messages, k + offset, train_on)
        if m["role"] in ("user", "system"):
            p.add("<|im_start|>" + m["role"] + "\n" + m["content"] + "<|im_end|>\n")
        elif m["role"] == "tool":
            if k == 0 or msgs[k - 1]["role"] != "tool":
                p.add("<|im_start|>user\n")
            p.add("<tool_response>\n" + m["content"] + "\n</tool_response>\n")
            if k == len(msgs) - 1 or msgs[k + 1]["role"] != "tool":
                p.add("<|im_end|>\n")
        else:
            keep = not (truncate and k < last_user)
            reasoning = m.get("reasoning_content")
            if reasoning and keep:
                body = "<think>\n" + reasoning + "\n</think>\n" + (m["content"] or "")
            elif reasoning:  # what follows the dropped reasoning's `</think>` stays
                body = "<think></think>\n" + (m["content"] or "")
            else:
                body = "<think></think>" + (m["content"] or "")
            body = body.strip()
            calls = m.get("tool_calls") or []
            if calls:
                body += "\n"
                for c in calls:
                    body += "<tool_call>\n<function=" + c["function"]["name"] + ">\n"
                    for a, v in c["function"]["arguments"].items():
                        body += "<parameter=" + a + ">\n" + str(v) + "\n</parameter>\n"
                    body += "</function>\n</tool_call>\n"
            p.add("<|im_start|>assistant\n")
            for head in ("<think>\n",) if think else ("<think></think>",):
                if body.startswith(head):  # part of the generation prompt
                    p.add(head)
                    body = body[len(head):]
            p.add(body + "<|im_end|>", sup)
            p.add("\n")
    return p


def oracle_nemotron_9b_v2(messages, tools, train_on, kwargs):
    """Nemotron Nano 9B v2: `<SPECIAL_10>System`, `<SPECIAL_11>User/Assistant`, turns closed by
    `\\n<SPECIAL_12>`; reasoning inline in content (`<think>..</think>`) is dropped, the final
    assistant turn is rendered after a `<think>\\n` (or `<think></think>` with /no_think), which
    is the generation prompt's (the header)."""
    no_think = any("/no_think" in m["content"] for m in messages if m["role"] in ("user", "system"))
    p = Pieces()
    msgs = list(messages)
    system = ""
    if msgs[0]["role"] == "system":
        system = msgs[0]["content"].replace("/think", "").replace("/no_think", "").strip()
        msgs = msgs[1:]
    p.add("<TOOLS-BLOCK>" if tools else "<SPECIAL_10>System\n" + system + "\n\n")
    offset = len(messages) - len(msgs)
    for k, m in enumerate(msgs):
        if m["role"] == "user":
            p.add("<SPECIAL_11>User\n"
                  + m["content"].replace("/think", "").replace("/no_think", "").strip() + "\n")
            continue
        if m["role"] == "tool":  # one message here; several would be joined by ", "
            p.add("<SPECIAL_11>User\n<TOOL_RESPONSE>[" + m["content"] + "]</TOOL_RESPONSE>")
            continue
        content = m["content"] or ""
        if "</think>" in content:
            content = content.split("</think>")[1]
        content = content.strip()
        calls = "<TOOLCALL>[" + ", ".join(
            json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            for c in m.get("tool_calls") or []) + "]</TOOLCALL>"
        sup = trained(messages, k + offset, train_on)
        if k < len(msgs) - 1:
            if m.get("tool_calls"):
                content += ("\n" if content else "") + calls
            p.add("<SPECIAL_11>Assistant\n")
            p.add(content + "\n<SPECIAL_12>", sup)
            p.add("\n")
            continue
        # the final reply: its text after a thinking opener, then its tool calls in a block
        # of their own
        if content:
            p.add("<SPECIAL_11>Assistant\n" + ("<think></think>" if no_think else "<think>\n"))
            p.add(content + "\n<SPECIAL_12>", sup)
            p.add("\n")
        if m.get("tool_calls"):
            p.add("<SPECIAL_11>Assistant\n")
            p.add(calls + "<SPECIAL_12>", sup)
            p.add("\n\n")
    return p


def template_text(name):
    """The template's text; the families' own templates come from ../shared (else a skip)."""
    shared = {"nemotron3_nano": NEMOTRON3_NANO_TEMPLATE,
              "nemotron_nano_9b_v2": NEMOTRON_NANO_9B_V2_TEMPLATE}
    if name in shared:
        return require_shared(shared[name]).read_text()
    return {"chatml": CHATML_TEMPLATE, "chatml_no_markers": CHATML_TEMPLATE_NO_GENERATION,
            "llama3": LLAMA3_TEMPLATE}[name]


ORACLES = {"chatml": oracle_chatml, "chatml_no_markers": oracle_chatml, "llama3": oracle_llama3,
           "nemotron3_nano": oracle_nemotron3, "nemotron_nano_9b_v2": oracle_nemotron_9b_v2}


def expected(tok, pieces, text):
    """``(ids, labels)`` of the pieces; the oracle's text is the rendering (a tool block
    placeholder stands for the template's own tool list, never supervised)."""
    if pieces and pieces[0][0] == "<TOOLS-BLOCK>":
        rest = "".join(t for t, _ in pieces[1:])
        assert text.endswith(rest)
        pieces = [(text[: len(text) - len(rest)], False)] + pieces[1:]
    assert "".join(t for t, _ in pieces) == text
    ids, mask = [], []
    for t, sup in pieces:
        piece = tok(t, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [sup] * len(piece)
    labels = [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]
    return ids, labels


def check(ctok, tmp_path, template, case, train_on="all", kwargs=None, record=None):
    record = record or CONVERSATIONS[case]
    path = tmp_path / f"{case}.jsonl"
    path.write_text(json.dumps(record) + "\n")
    tmpl = template_text(template)
    ds = build_chat_dataset(path, ctok, chat_template=tmpl, train_on=train_on,
                            chat_template_kwargs=kwargs, cache_dir=False)
    text = ctok.apply_chat_template(record["messages"], tools=record.get("tools"),
                                    chat_template=tmpl, tokenize=False, **(kwargs or {}))
    ids, labels = expected(ctok, ORACLES[template](record["messages"], record.get("tools"),
                                                  train_on, kwargs or {}), text)
    assert ds[0]["input_ids"].tolist() == ctok(text, add_special_tokens=False)["input_ids"]
    assert ds[0]["input_ids"].tolist() == ids
    got, want = ds[0]["labels"].tolist(), labels
    assert got == want, (ctok.decode([t for t in got if t != -100]),
                         ctok.decode([t for t in want if t != -100]))
    return ctok.decode([t for t in got if t != -100])


CASES = {
    "chatml": ["single", "multi", "tools", "tool_call_last"],
    "chatml_no_markers": ["single", "multi", "tools", "tool_call_last"],
    "llama3": ["single", "multi", "tools", "tool_call_last"],
    "nemotron3_nano": ["single", "multi", "reasoning", "tools", "tool_call_last"],
    "nemotron_nano_9b_v2": ["single", "multi", "tools", "tool_call_last"],
}


@pytest.mark.parametrize("train_on", ["all", "last"])
@pytest.mark.parametrize("template,case", [(t, c) for t, cs in CASES.items() for c in cs])
def test_masks_match_the_oracle(ctok, tmp_path, template, case, train_on):
    check(ctok, tmp_path, template, case, train_on)


def test_nemotron3_nano_keeps_or_drops_history_reasoning(ctok, tmp_path):
    sup = check(ctok, tmp_path, "nemotron3_nano", "reasoning")
    assert "Add two and two." not in sup and "4 times 3 is 12." in sup  # dropped from history
    sup = check(ctok, tmp_path, "nemotron3_nano", "reasoning",
                kwargs={"truncate_history_thinking": False})
    assert "Add two and two." in sup and "4 times 3 is 12." in sup
    sup = check(ctok, tmp_path, "nemotron3_nano", "multi", kwargs={"enable_thinking": False})
    assert "<think>" not in sup  # `<think></think>` belongs to the generation prompt then
    assert check(ctok, tmp_path, "nemotron3_nano", "single").startswith("<think></think>")


def test_nemotron_nano_9b_v2_reasoning_inline_and_no_think(ctok, tmp_path):
    record = {"messages": [
        {"role": "system", "content": "Be brief. /no_think"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>Add them.</think>4"},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "12"}]}
    sup = check(ctok, tmp_path, "nemotron_nano_9b_v2", "inline", record=record)
    assert sup == "4\n<SPECIAL_12>12\n<SPECIAL_12>"


def test_dataset_section_options_from_yaml(ctok, tmp_path):
    """The options as a recipe's dataset section gives them (YAML, `_target_`)."""
    import yaml

    from hybridtrain.config.instantiate import instantiate

    record = CONVERSATIONS["reasoning"]
    (tmp_path / "c.jsonl").write_text(json.dumps(record) + "\n")
    section = yaml.safe_load(f"""
        _target_: hybridtrain.data.build_chat_dataset
        path: {tmp_path / "c.jsonl"}
        chat_template_path: {require_shared(NEMOTRON3_NANO_TEMPLATE)}
        chat_template_kwargs: {{truncate_history_thinking: false}}
        cache_dir: false
    """)
    ds = instantiate(section, tokenizer=ctok)
    sup = ctok.decode([t for t in ds[0]["labels"].tolist() if t != -100])
    # both turns keep their reasoning; each opens with the generation prompt's `<think>\n`
    assert sup == ("Add two and two.\n</think>\n4<|im_end|>"
                   "4 times 3 is 12.\n</think>\n12<|im_end|>")


# ------------------------------------------------------------------------- template errors
REFUSE_SYSTEM = ("{% if messages[0]['role'] == 'system' %}"
                 "{{ raise_exception('System role not supported') }}{% endif %}")


@pytest.mark.parametrize("base", ["chatml", "chatml_no_markers"])  # both mask strategies
def test_a_template_that_raises_names_the_template_file_and_the_record(ctok, tmp_path, base):
    from hybridtrain.data import ChatFormatError

    template = tmp_path / "refuse_system.jinja"
    template.write_text(REFUSE_SYSTEM + template_text(base))
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(CONVERSATIONS["single"]) + "\n"
                    + json.dumps(CONVERSATIONS["multi"]) + "\n")  # line 2 has a system turn
    with pytest.raises(ChatFormatError) as e:
        build_chat_dataset(data, ctok, chat_template_path=str(template), cache_dir=False)
    msg = str(e.value)
    assert f"{data} line 2" in msg and str(template) in msg and "System role not supported" in msg


def test_a_template_that_does_not_parse_names_its_file_and_line(ctok, tmp_path):
    from hybridtrain.data import ChatFormatError

    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(CONVERSATIONS["single"]) + "\n")
    with pytest.raises(ChatFormatError, match=f"{template} does not parse: line 2"):
        build_chat_dataset(data, ctok, chat_template_path=str(template), cache_dir=False)
