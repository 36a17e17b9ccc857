"""Tokenizers: load a local Hugging Face tokenizer offline, or train a small byte-level BPE.

- ``load_tokenizer(path, **kwargs)``: ``AutoTokenizer`` from a local directory with
  ``local_files_only=True`` (never the Hub) and ``trust_remote_code=False``: the Python files of a
  tokenizer folder never run (``trust_remote_code=True`` and the Hub options are refused, also
  when a recipe or a dataset builder forwards them). A tokenizer without a pad token gets its
  eos token as pad token.
- ``build_bpe_tokenizer(texts, out_dir, vocab_size=4000, min_frequency=2,
  chat_template=CHATML_TEMPLATE)``: trains a byte-level BPE with the ``tokenizers`` library on
  ``texts`` and saves a standard HF tokenizer directory (``tokenizer.json``,
  ``tokenizer_config.json``, ``chat_template.jinja``) with the special tokens ``<|pad|>`` (pad),
  ``<|endoftext|>`` (eos), ``<|im_start|>`` and ``<|im_end|>`` (chat turns). Returns the tokenizer
  as loaded back from ``out_dir``. Safe when several ranks build the same tokenizer at once
  (files are renamed into place; a file that holds the same bytes is not rewritten).
- ``CHATML_TEMPLATE``: a ChatML template (system/user/assistant/tool turns, optional ``tools``
  and assistant ``tool_calls``) whose assistant content and ``<|im_end|>`` sit inside
  ``{% generation %}`` markers, so ``apply_chat_template(..., return_assistant_tokens_mask=True)``
  marks exactly what the model should learn to emit. ``CHATML_TEMPLATE_NO_GENERATION`` is the same
  template without the markers.
- ``tokenizer_fingerprint(tokenizer)``: a stable hash of everything that changes token ids
  (vocabulary, merges, normalizer, special tokens, chat template); part of every cache key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from hybridtrain.fileio import BOM, publish_files, read_json, strip_bom, text_reader

from .io import DataError, decode_utf8

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, IM_START, IM_END]

# ChatML. Assistant content and its end-of-turn token are inside {% generation %}; the header
# "<|im_start|>assistant\n" and the newline after <|im_end|> are not.
CHATML_TEMPLATE = (
    "{%- set loop_messages = messages -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- endif -%}"
    "{{- 'You may call these tools:\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}"
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>' -}}{{- {'name': fn['name'], 'arguments': fn['arguments']} | tojson -}}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
CHATML_TEMPLATE_NO_GENERATION = CHATML_TEMPLATE.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)

_GENERATION_RE = re.compile(r"{%-?\s*generation\s*-?%}")


def template_has_generation_markers(template: str | None) -> bool:
    return bool(template) and bool(_GENERATION_RE.search(template))


def as_tokenizer(tokenizer, trust_remote_code: bool = False):
    """``tokenizer`` itself, or the tokenizer loaded from it when it is a path.
    ``trust_remote_code`` is accepted only as ``False`` (see :func:`refuse_code_loading`)."""
    refuse_code_loading({"trust_remote_code": trust_remote_code})
    if isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):
        return load_tokenizer(tokenizer)
    return tokenizer


# options of ``from_pretrained`` that would run a folder's code or reach the network
_REFUSED_OPTIONS = ("trust_remote_code", "local_files_only", "revision", "code_revision",
                    "force_download", "token", "use_auth_token", "proxies", "cache_dir",
                    "subfolder")


def refuse_code_loading(options: dict) -> None:
    """Raise :class:`DataError` for a tokenizer option that would run code from a folder
    (``trust_remote_code`` other than False) or reach the Hub (``local_files_only``,
    ``revision``, ``token``, ...; private ``_`` options too): hybridtrain loads tokenizers
    offline and never runs a folder's Python files."""
    for key, value in options.items():
        if key == "trust_remote_code" and value in (False, None):
            continue
        if key in _REFUSED_OPTIONS or key.startswith("_"):
            raise DataError(
                f"tokenizer option {key}={value!r} is refused: hybridtrain loads tokenizers from "
                "a local folder only and never runs Python code from it (docs/safety.md, "
                "'Untrusted files'). Remove the option; a tokenizer that needs its own code must "
                "be saved as a standard tokenizer.json first")


def _custom_code(folder: Path) -> str | None:
    """Where ``folder`` asks for its own Python code (an ``auto_map`` in its tokenizer or model
    config)."""
    for name in ("tokenizer_config.json", "config.json"):
        try:
            auto_map = read_json(folder / name).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(auto_map, dict) and auto_map:
            key = "AutoTokenizer" if "AutoTokenizer" in auto_map else next(iter(auto_map))
            return f"auto_map {key}: {auto_map[key]!r} in {folder / name}"
    return None


TEXT_SUFFIXES = (".json", ".txt", ".jinja")  # the text files of a tokenizer folder


def check_text_files(folder: Path) -> None:
    """Raise :class:`EncodingError` (file, line) for a text file in ``folder`` that is not UTF-8."""
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name.endswith(TEXT_SUFFIXES):
            decode_utf8(f.read_bytes(), f)


def _starts_with_bom(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(BOM)) == BOM


@contextlib.contextmanager
def without_boms(folder: Path):
    """``folder`` itself, or (when one of its text files starts with a UTF-8 byte-order mark,
    which transformers and ``tokenizers`` refuse) a temporary copy of its files with the marks
    dropped."""
    texts = [f for f in folder.iterdir() if f.is_file() and f.name.endswith(TEXT_SUFFIXES)]
    if not any(_starts_with_bom(f) for f in texts):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="hybridtrain-tokenizer-") as tmp:
        for f in folder.iterdir():
            if f.is_file():
                data = f.read_bytes()
                (Path(tmp) / f.name).write_bytes(strip_bom(data) if f in texts else data)
        yield Path(tmp)


@text_reader("tokenizer")
def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False, **kwargs):
    """Load a tokenizer from a local directory, never from the network, never running a
    folder's code (``trust_remote_code`` is accepted only as False; other ``kwargs`` go to
    ``AutoTokenizer.from_pretrained`` unless :func:`refuse_code_loading` refuses them)."""
    from transformers import AutoTokenizer

    refuse_code_loading({"trust_remote_code": trust_remote_code, **kwargs})
    p = Path(os.path.expanduser(str(path)))
    if not p.is_dir():
        raise DataError(
            f"tokenizer path {str(path)!r} is not a local directory; hybridtrain loads tokenizers "
            "offline only (download it first, e.g. with `hf download`, and pass the folder)"
        )
    try:
        with without_boms(p) as folder:
            tok = AutoTokenizer.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=False, **kwargs
            )
        tok.name_or_path = str(p)
    except Exception as e:
        check_text_files(p)  # a file that is not UTF-8 is named with its line
        if not isinstance(e, (OSError, ValueError)):
            raise
        raise DataError(_load_failure(p, e)) from e
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def _load_failure(folder: Path, e: Exception) -> str:
    """The message of a tokenizer folder that did not load: its own code asked for, its
    ``tokenizer.json`` missing, or transformers' own words."""
    code = _custom_code(folder)
    if code is not None and "trust_remote_code" in str(e):
        return (f"the tokenizer in {folder} asks to run its own Python code ({code}); "
                "hybridtrain never runs code from a tokenizer folder (docs/safety.md). Give it a "
                "standard tokenizer: a tokenizer.json and a tokenizer_class transformers knows "
                "(e.g. PreTrainedTokenizerFast) in tokenizer_config.json")
    if not (folder / "tokenizer.json").is_file():
        present = ", ".join(sorted(f.name for f in folder.iterdir())) or "nothing"
        return (f"could not load a tokenizer from {folder}: {folder / 'tokenizer.json'} is "
                f"missing (the folder holds: {present}); copy the "
                "model's tokenizer.json into it (a folder with only a slow tokenizer's files, "
                "such as tokenizer.model, needs sentencepiece or tiktoken to convert them)")
    return f"could not load a tokenizer from {folder}: {e}"


def build_bpe_tokenizer(
    texts: Iterable[str],
    out_dir: str | os.PathLike,
    vocab_size: int = 4000,
    min_frequency: int = 2,
    chat_template: str | None = CHATML_TEMPLATE,
    model_max_length: int = 1 << 20,
    extra_special_tokens: Sequence[str] = (),
):
    """Train a byte-level BPE on ``texts``, save it to ``out_dir`` as an HF tokenizer, load it back.
    ``extra_special_tokens`` (e.g. ``["<image>"]``) are single tokens after the chat ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise DataError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens)"
        )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS + list(extra_special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((t for t in texts if t), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        extra_special_tokens=[IM_START, IM_END, *extra_special_tokens],
        chat_template=chat_template,
        model_max_length=model_max_length,
    )
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # saved into a private folder, then each file renamed into place: several ranks may build
    # the same tokenizer at once, and a rank may load it while another writes it
    tmp = tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent)
    try:
        hf.save_pretrained(tmp)
        publish_files(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(out_dir)


def encode_batch(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of ``texts`` (new lists), as ``tokenizer(texts)["input_ids"]`` gives them.

    A fast tokenizer's Rust backend is called directly when it has no truncation or padding
    state (the ids are the same; it skips building the per-text Python encodings).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and backend.truncation is None and backend.padding is None:
        fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in fast(texts, add_special_tokens=add_special_tokens)]
    ids = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [list(x) for x in ids]


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of everything that determines the token ids a tokenizer produces."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        # Call-time settings that the tokenizer object mutates; they do not change the vocabulary.
        state.pop("truncation", None)
        state.pop("padding", None)
        h.update(json.dumps(state, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
    h.update(json.dumps(specials, sort_keys=True).encode())
    for attr in ("add_bos_token", "add_eos_token", "padding_side"):
        h.update(f"{attr}={getattr(tokenizer, attr, None)}".encode())
    template = getattr(tokenizer, "chat_template", None)
    h.update(json.dumps(template, sort_keys=True).encode())
    return h.hexdigest()
