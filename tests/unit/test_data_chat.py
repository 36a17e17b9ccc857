"""Chat data: loss on assistant content + end-of-turn only, checked token by token."""

from __future__ import annotations

import json
import logging

import pytest

from hybridtrain.data import (
    CHATML_TEMPLATE,
    CHATML_TEMPLATE_NO_GENERATION,
    ChatDataset,
    ChatFormatError,
    EmptyDatasetError,
    build_chat_dataset,
)

TEMPLATES = {"generation": CHATML_TEMPLATE, "no_generation": CHATML_TEMPLATE_NO_GENERATION}

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Who ruled Normandy?"},
    {"role": "assistant", "content": "Rollo, in 911."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "His descendants, the dukes of Normandy."},
]


def expected(tok, messages, train_on="all"):
    """Token ids and supervision mask built piece by piece from the ChatML layout."""
    ids, mask = [], []
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")

    def add(text, sup):
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids.extend(t)
        mask.extend([sup] * len(t))

    for i, m in enumerate(messages):
        add("<|im_start|>" + m["role"] + "\n", 0)  # the header is never supervised
        sup = int(m["role"] == "assistant" and (train_on == "all" or i == last))
        add(m["content"] + "<|im_end|>", sup)
        add("\n", 0)
    labels = [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]
    return ids, labels


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


@pytest.mark.parametrize("template", ["generation", "no_generation"])
@pytest.mark.parametrize("train_on", ["all", "last"])
def test_masks_token_by_token(tok, tmp_path, template, train_on):
    convs = [
        MULTI_TURN,
        MULTI_TURN[1:3],  # single turn, no system prompt
        [{"role": "system", "content": "S."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}],
    ]
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    ds = build_chat_dataset(p, tok, chat_template=TEMPLATES[template], train_on=train_on,
                            cache_dir=False)
    assert len(ds) == len(convs)
    for i, conv in enumerate(convs):
        ids, labels = expected(tok, conv, train_on)
        assert ds[i]["input_ids"].tolist() == ids
        assert ds[i]["labels"].tolist() == labels
        sup = [l for l in labels if l != -100]
        assert "assistant" not in tok.decode(sup)  # never the header
        assert tok.decode(sup).endswith("<|im_end|>")


def test_generation_and_placeholder_strategies_agree_with_tools(tok, tmp_path):
    conv = {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny, 21C"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    }
    p = write_jsonl(tmp_path / "t.jsonl", [conv])
    gen = build_chat_dataset(p, tok, mask_strategy="generation", cache_dir=False)
    pre = build_chat_dataset(p, tok, mask_strategy="placeholder", cache_dir=False)
    assert gen[0]["input_ids"].tolist() == pre[0]["input_ids"].tolist()
    assert gen[0]["labels"].tolist() == pre[0]["labels"].tolist()
    text = tok.decode(gen[0]["input_ids"])
    assert '"name": "get_weather"' in text and "Current weather" in text
    sup = tok.decode([l for l in gen[0]["labels"].tolist() if l != -100])
    assert sup == ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                   "<|im_end|>It is sunny.<|im_end|>")


def test_sharegpt_and_parquet_and_datasets(tok, tmp_path):
    import datasets

    sg = {"system": "You are terse.", "conversations": [
        {"from": "human", "value": "Who ruled Normandy?"},
        {"from": "gpt", "value": "Rollo, in 911."},
        {"from": "human", "value": "And then?"},
        {"from": "gpt", "value": "His descendants, the dukes of Normandy."},
    ]}
    ids, labels = expected(tok, MULTI_TURN)
    p = write_jsonl(tmp_path / "sg.jsonl", [sg])
    pq = tmp_path / "m.parquet"
    datasets.Dataset.from_list([{"messages": MULTI_TURN}]).to_parquet(str(pq))
    js = tmp_path / "m.json"
    js.write_text(json.dumps([{"messages": MULTI_TURN}]))
    hf = datasets.Dataset.from_list([{"messages": MULTI_TURN}])
    for src in (p, pq, js, hf):
        ds = ChatDataset(src, tok, cache_dir=False)
        assert ds[0]["input_ids"].tolist() == ids
        assert ds[0]["labels"].tolist() == labels


def test_truncation_keeps_or_drops(tok, tmp_path, caplog):
    long_user = {"role": "user", "content": "word " * 200}
    convs = [
        {"messages": MULTI_TURN},
        {"messages": [long_user, {"role": "assistant", "content": "ok"}]},
    ]
    p = write_jsonl(tmp_path / "c.jsonl", convs)
    full_ids, full_labels = expected(tok, MULTI_TURN)
    L = len(full_ids) - 5  # cuts into the last assistant turn
    with caplog.at_level(logging.WARNING, logger="hybridtrain.data"):
        ds = build_chat_dataset(p, tok, seq_length=L, padding="max_length", cache_dir=False)
    assert len(ds) == 1 and ds.stats["dropped"] == {"no_supervised_tokens_after_truncation": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dropped 1 of 2" in warnings[0]
    ex = ds[0]
    assert len(ex["input_ids"]) == L
    assert ex["input_ids"].tolist() == full_ids[:L]
    assert ex["labels"].tolist() == full_labels[: L - 1] + [-100]
    with pytest.raises(EmptyDatasetError, match="1 no_supervised_tokens_after_truncation"):
        build_chat_dataset(write_jsonl(tmp_path / "d.jsonl", convs[1:]), tok, seq_length=50,
                           cache_dir=False)


def test_no_assistant_turn_is_rejected(tok, tmp_path):
    p = write_jsonl(tmp_path / "c.jsonl", [
        {"messages": MULTI_TURN},
        {"id": "conv-7", "messages": [{"role": "user", "content": "hello?"}]},
    ])
    with pytest.raises(ChatFormatError, match=r"c\.jsonl line 2 \(id 'conv-7'\): .*no assistant turn"):
        build_chat_dataset(p, tok, cache_dir=False)


def test_bad_chat_records(tok, tmp_path):
    cases = [
        ({"messages": [{"role": "wizard", "content": "x"}]}, ChatFormatError, "unknown role 'wizard'"),
        ({"messages": [{"content": "x"}]}, ValueError, r"messages\[0\]: missing required field 'role'"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, ChatFormatError, "unknown speaker"),
        ({"text": "plain"}, ValueError, "missing required field 'messages'"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, ValueError,
         r"messages\[0\]: missing required field 'content'"),
    ]
    for k, (rec, exc, msg) in enumerate(cases):
        p = write_jsonl(tmp_path / f"b{k}.jsonl", [rec])
        with pytest.raises(exc, match=msg):
            build_chat_dataset(p, tok, cache_dir=False)


def test_template_that_is_not_prefix_stable(tok, tmp_path):
    # Renders the last assistant turn differently from the earlier ones: the supervised tokens
    # are what the whole rendering holds, its "!" included.
    bad = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
           "{%- if loop.last -%}{{- m['content'] + '!<|im_end|>\\n' -}}"
           "{%- else -%}{{- m['content'] + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
           "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": MULTI_TURN}])
    ds = build_chat_dataset(p, tok, chat_template=bad, cache_dir=False)
    sup = tok.decode([t for t in ds[0]["labels"].tolist() if t != -100])
    assert sup == "Rollo, in 911.<|im_end|>His descendants, the dukes of Normandy.!<|im_end|>"


def test_cache_key_includes_chat_options(tok, tmp_path):
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": MULTI_TURN}])
    a = build_chat_dataset(p, tok, cache_dir=tmp_path / "cache")
    b = build_chat_dataset(p, tok, cache_dir=tmp_path / "cache")
    c = build_chat_dataset(p, tok, cache_dir=tmp_path / "cache", train_on="last")
    d = build_chat_dataset(p, tok, cache_dir=tmp_path / "cache",
                           chat_template=CHATML_TEMPLATE_NO_GENERATION)
    assert a.cache_path == b.cache_path
    assert len({a.cache_path, c.cache_path, d.cache_path}) == 3
    assert a[0]["labels"].tolist() != c[0]["labels"].tolist()


def test_empty_assistant_turns_are_not_trained_on_and_counted(tok, tmp_path, caplog):
    turns = [dict(m) for m in MULTI_TURN]
    turns[2]["content"] = "  "  # an empty answer in the middle: the rest is kept
    p = write_jsonl(tmp_path / "c.jsonl", [
        {"messages": turns},
        {"messages": MULTI_TURN[1:2] + [{"role": "assistant", "content": ""}]},  # nothing left
        {"messages": MULTI_TURN},
    ])
    with caplog.at_level(logging.WARNING, logger="hybridtrain.data"):
        ds = build_chat_dataset(p, tok, cache_dir=False)
    assert len(ds) == 2 and ds.stats["dropped"] == {"empty_assistant_content": 1}
    assert ds.stats["turns_skipped"] == {"empty_assistant_content": 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "dropped 1 of 3" in warnings[0] and "2 assistant turns not trained on" in warnings[0]
    sup = tok.decode([t for t in ds[0]["labels"].tolist() if t != -100])
    assert sup == "His descendants, the dukes of Normandy.<|im_end|>"  # only the non-empty turn
    for strategy in ("generation", "placeholder"):
        ds = build_chat_dataset(p, tok, cache_dir=False, mask_strategy=strategy)
        assert tok.decode([t for t in ds[0]["labels"].tolist() if t != -100]) == sup


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_non_utf8_bytes_name_file_and_line(tok, tmp_path, suffix):
    from hybridtrain.data import EncodingError

    good = json.dumps({"messages": MULTI_TURN})
    bad = '{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1")
    p = tmp_path / f"c.{suffix}"
    if suffix == "jsonl":
        p.write_bytes(good.encode() + b"\n" + bad + b"\n")
        line = 2
    else:
        p.write_bytes(b"[\n" + good.encode() + b",\n" + bad + b"\n]\n")
        line = 3
    with pytest.raises(EncodingError, match=rf"c\.{suffix}: line {line}: column 47: .*not UTF-8"):
        build_chat_dataset(p, tok, cache_dir=False)


def test_template_file_and_options_from_the_dataset_section(tok, tmp_path):
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text(
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] -}}"
        "{%- if greeting is defined and m['role'] == 'assistant' -%}{{- greeting -}}{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": MULTI_TURN[1:3]}])
    ds = build_chat_dataset(p, tok, chat_template_path=tmpl, cache_dir=False,
                            chat_template_kwargs={"greeting": " Bye."})
    assert tok.decode([t for t in ds[0]["labels"].tolist() if t != -100]) == (
        "Rollo, in 911. Bye.<|im_end|>")
    with pytest.raises(ValueError, match="chat_template or chat_template_path, not both"):
        build_chat_dataset(p, tok, chat_template="x", chat_template_path=tmpl, cache_dir=False)
    with pytest.raises(ValueError, match="chat_template_path: .* is not a file"):
        build_chat_dataset(p, tok, chat_template_path=tmp_path / "none.jinja", cache_dir=False)
    with pytest.raises(ValueError, match="chat_template_kwargs must be a mapping"):
        build_chat_dataset(p, tok, chat_template_kwargs=["x"], cache_dir=False)


@pytest.mark.parametrize("body,message", [
    ("m['content'] + m['content']", "renders the assistant text more than once"),
    ("m['content'] | upper", "different structure than with placeholder text"),
    ("m['content'][:2]", "altered"),
])
def test_templates_whose_turns_cannot_be_located_name_record_and_turn(tok, tmp_path, body,
                                                                      message):
    tmpl = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
            "{%- if m['role'] == 'assistant' -%}{{- " + body + " -}}{%- else -%}"
            "{{- m['content'] -}}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": MULTI_TURN}, {"messages": MULTI_TURN}])
    with pytest.raises(ChatFormatError,
                       match=rf"c\.jsonl line 1 messages\[2\] \(assistant\): .*{message}"):
        build_chat_dataset(p, tok, chat_template=tmpl, cache_dir=False)


def test_template_without_generation_prompt(tok, tmp_path):
    # Mistral-like: no generation prompt; the reply's first token carries the template's space
    # (" Rollo"): a token that overlaps the reply is supervised.
    tmpl = ("{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
            "{{- '[INST] ' + m['content'] + ' [/INST]' -}}{%- elif m['role'] == 'assistant' -%}"
            "{{- ' ' + m['content'] + '<|endoftext|>' -}}{%- endif -%}{%- endfor -%}")
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": MULTI_TURN[1:]}])
    ds = build_chat_dataset(p, tok, chat_template=tmpl, cache_dir=False)
    ids = ds[0]["input_ids"].tolist()
    text = "[INST] Who ruled Normandy? [/INST] Rollo, in 911.<|endoftext|>[INST] And then? [/INST]"
    first = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[: len(first)] == first
    sup = tok.decode([t for t in ds[0]["labels"].tolist() if t != -100])
    assert sup == " Rollo, in 911.<|endoftext|> His descendants, the dukes of Normandy.<|endoftext|>"
