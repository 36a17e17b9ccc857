"""``hybridtrain generate``: complete prompts with a trained model.

    hybridtrain generate --model DIR [--adapter DIR] (--prompt TEXT | --prompts FILE.jsonl)
        [--chat] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
        [--batch-size B] [--output OUT.jsonl] [--dtype D] [--device D]

``--model``: a Hugging Face folder, or a run folder / ``step_N`` checkpoint (its export:
``merged_hf/``, ``hf/``, or ``adapter/`` on the base recorded in the adapter; a step without an
export: its sharded checkpoint, read as ``hybridtrain convert`` reads it). ``--prompts``:
JSONL records with ``prompt`` (text) or ``messages`` (a chat, always rendered with the chat
template). ``--chat`` renders each text prompt as one user turn with the tokenizer's chat template
and its generation prompt. Greedy unless ``--temperature`` or ``--top-k``/``--top-p`` is given.
Writes one JSON object per prompt (``prompt``, ``completion``, ``new_tokens``, ``tokens_per_s``
of its batch) to stdout or ``--output``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence

import torch

from hybridtrain.config.dtypes import DTYPE_NAMES, to_torch_dtype
from hybridtrain.data import load_tokenizer
from hybridtrain.data.templates import apply_template
from hybridtrain.models.spec import Decoding, get_model_spec
from hybridtrain.peft.export import load_peft_adapter
from hybridtrain.runfolder import latest_checkpoint
from hybridtrain.training.checkpoint import load_checkpoint_model, step_folder
from hybridtrain.training.evaluation import left_pad

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- loading
def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None


def resolve_export(path: str) -> tuple[str, str | None]:
    """(Hugging Face folder, adapter folder or None) that ``path`` names: a run folder (its
    ``latest`` checkpoint), a ``step_N`` checkpoint (its export: ``merged_hf/``, ``hf/``, then
    ``adapter/``; its own ``config.json`` is the model config, not an export), an adapter folder
    or an HF folder."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"--model {path}: no such folder")
    path = latest_checkpoint(path) or path
    for sub in ("merged_hf", "hf"):
        if os.path.isfile(os.path.join(path, sub, "config.json")):
            return os.path.join(path, sub), None
    adapter = os.path.join(path, "adapter") if os.path.isdir(os.path.join(path, "adapter")) else path
    if os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        base = _read_json(os.path.join(adapter, "adapter_config.json")).get("base_model_name_or_path")
        for root in (os.getcwd(), adapter):
            if base and os.path.isfile(os.path.join(root, base, "config.json")):
                return os.path.abspath(os.path.join(root, base)), adapter
        raise ValueError(f"{adapter} is a LoRA adapter whose base model ({base!r}) is not a local "
                         "folder here; pass --model BASE_DIR --adapter ADAPTER_DIR")
    if os.path.isfile(os.path.join(path, "trainer_state.json")):  # a checkpoint, no export
        raise ValueError(f"--model {path}: a checkpoint without an export (hf/, merged_hf/ or "
                         f"adapter/); write one with `hybridtrain convert {path} OUT_DIR`")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, None
    raise ValueError(f"--model {path}: neither a Hugging Face folder (config.json) nor a checkpoint "
                     "or run folder with an export (hf/, merged_hf/ or adapter/)")


def unexported_checkpoint(path: str) -> str | None:
    """The ``step_N`` checkpoint ``path`` names (itself, or a run folder's ``latest``) when it
    holds no export (``hf/``, ``merged_hf/``, ``adapter/``); else None."""
    path = step_folder(path)
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        return None
    exported = any(os.path.isfile(os.path.join(path, sub, name)) for sub, name in
                   (("merged_hf", "config.json"), ("hf", "config.json"),
                    ("adapter", "adapter_config.json")))
    return None if exported else path


def load_model(model_dir: str, adapter_dir: str | None = None, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu"):
    """(model, tokenizer) for generation: the model class registered for the folder's
    ``model_type``, with a PEFT adapter applied when given (not merged); a ``step_N`` checkpoint
    without an export: the model its sharded checkpoint holds, with its tokenizer."""
    step_dir = unexported_checkpoint(model_dir)
    if step_dir is not None:
        if adapter_dir:
            raise ValueError(f"--adapter {adapter_dir}: {step_dir} is a training checkpoint (it "
                             "holds its own adapters, if any); pass a Hugging Face folder as --model")
        tok_dir = os.path.join(step_dir, "tokenizer")
        if not os.path.isdir(tok_dir):
            raise ValueError(f"{step_dir} has no tokenizer/ (its run had no tokenizer); export it "
                             f"with `hybridtrain convert {step_dir} OUT_DIR` and add one")
        model, _ = load_checkpoint_model(step_dir)
        logger.info("%s has no export: loaded its sharded checkpoint", step_dir)
        if dtype is not None:
            model = model.to(to_torch_dtype(dtype, "--dtype"))
        return model.to(device).eval(), load_tokenizer(tok_dir)
    hf_dir, found_adapter = resolve_export(model_dir)
    adapter_dir = adapter_dir or found_adapter
    model_type = _read_json(os.path.join(hf_dir, "config.json")).get("model_type")
    spec = get_model_spec(str(model_type))
    spec.part(Decoding, "hybridtrain generate")  # the family generates text
    model = spec.model_cls.from_pretrained(hf_dir, dtype=dtype)
    if adapter_dir:
        load_peft_adapter(model, adapter_dir)
    tok_dir = adapter_dir if adapter_dir and os.path.isfile(os.path.join(adapter_dir, "tokenizer_config.json")) \
        else hf_dir
    return model.to(device).eval(), load_tokenizer(tok_dir)


def stop_token_ids(tokenizer, hf_dir: str | None = None, chat: bool = False) -> list[int]:
    """eos, the ids of the folder's ``generation_config.json``, and with ``chat`` the special
    token that ends an assistant turn in the chat template."""
    ids = {tokenizer.eos_token_id}
    gen = os.path.join(hf_dir, "generation_config.json") if hf_dir else ""
    if gen and os.path.isfile(gen):
        e = _read_json(gen).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e])
    if chat and getattr(tokenizer, "chat_template", None):
        text = apply_template(
            tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
            tokenize=False)
        rest = tokenizer.encode(text[text.rfind("ok") + 2:], add_special_tokens=False)
        special = set(tokenizer.all_special_ids)
        ids.update(t for t in rest[:3] if t in special)
    return sorted(i for i in ids if i is not None)


def encode_prompt(tokenizer, record: dict, chat: bool, where: str = "") -> list[int]:
    """Token ids of a prompt record: ``messages`` (or, with ``chat``, ``prompt`` as one user turn)
    rendered by the chat template with its generation prompt; else the plain text."""
    if "messages" in record or chat:
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        text = apply_template(tokenizer, messages, where, add_generation_prompt=True,
                              tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(record["prompt"], add_special_tokens=True)


def check_prompt(record: dict, where: str) -> dict:
    """``record`` if its prompt can be completed: non-empty text, or a non-empty list of
    messages; else a ValueError naming ``where`` (``--prompt`` or ``FILE:LINE``)."""
    if "messages" in record:
        if not isinstance(record["messages"], list) or not record["messages"]:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                             "{role, content} messages")
    elif not isinstance(record["prompt"], str) or not record["prompt"].strip():
        got = "empty" if isinstance(record["prompt"], str) else type(record["prompt"]).__name__
        raise ValueError(f"{where}: the prompt is {got}; give the text the model should continue")
    return record


def read_prompts(path: str) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(rec, dict) or not ({"prompt", "messages"} & rec.keys()):
                raise ValueError(f"{path}:{n}: a record needs 'prompt' (text) or 'messages' (a chat)")
            out.append(check_prompt(rec, f"{path}:{n}"))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# ---------------------------------------------------------------------------------- generation
def complete(model, tokenizer, prompts: list[list[int]], *, batch_size: int = 8, stop_ids=None,
             **gen_kwargs) -> list[dict]:
    """Generate for token prompts in left-padded batches; per prompt ``completion`` (text,
    without the stop token), ``new_tokens`` and its batch's ``tokens_per_s``."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    for b in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[b:b + batch_size], pad)
        t0 = time.perf_counter()
        seqs = model.generate(ids.to(device), attention_mask=mask.to(device), eos_token_id=stop_ids or None,
                              **gen_kwargs)
        dt = time.perf_counter() - t0
        stops = set(stop_ids or ())
        rows = []
        for row in seqs[:, ids.shape[1]:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), None)
            rows.append((row, len(row)) if cut is None else (row[:cut], cut + 1))
        n_new = sum(n for _, n in rows)
        out += [{"completion": tokenizer.decode(text_ids, skip_special_tokens=False), "new_tokens": n,
                 "tokens_per_s": n_new / dt if dt > 0 else None} for text_ids, n in rows]
    return out


def _plain(doc: str) -> str:
    """Docstring text for a terminal: reStructuredText ````literals```` without their quotes."""
    return re.sub(r"``([^`]*)``", r"\1", doc)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridtrain generate",
                                description="Complete prompts with a trained model.\n\n"
                                + _plain(__doc__.split("\n\n", 2)[2]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder, run folder or step_N checkpoint")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter folder to apply")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (text)")
    src.add_argument("--prompts", metavar="FILE.jsonl", help="JSONL with 'prompt' or 'messages' per line")
    p.add_argument("--chat", action="store_true", help="render text prompts with the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt at most")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus probability")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together")
    p.add_argument("--output", default=None, help="write JSONL here instead of stdout")
    p.add_argument("--dtype", default=None, choices=DTYPE_NAMES, help="default: as stored")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when available, else cpu")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    records = read_prompts(args.prompts) if args.prompts else \
        [check_prompt({"prompt": args.prompt}, "--prompt")]
    model, tok = load_model(args.model, args.adapter, dtype=args.dtype, device=device)
    if args.chat and not getattr(tok, "chat_template", None):
        raise ValueError("--chat: the tokenizer has no chat template")
    prompts = [encode_prompt(tok, r, args.chat, "--prompt" if args.prompts is None
                             else f"{args.prompts} record {i + 1}") for i, r in enumerate(records)]
    do_sample = args.temperature is not None or args.top_k > 0 or args.top_p < 1.0
    hf_dir = None if unexported_checkpoint(args.model) else resolve_export(args.model)[0]
    results = complete(model, tok, prompts, batch_size=args.batch_size,
                       stop_ids=stop_token_ids(tok, hf_dir, chat=args.chat or any("messages" in r for r in records)),
                       max_new_tokens=args.max_new_tokens, do_sample=do_sample,
                       temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for rec, res in zip(records, results):
            out.write(json.dumps({"prompt": rec.get("prompt", rec.get("messages")), **res}, ensure_ascii=False) + "\n")
    finally:
        if args.output:
            out.close()
            logger.info("wrote %d completions to %s", len(results), args.output)
    return 0
