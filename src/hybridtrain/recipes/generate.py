"""``hybridtrain generate``: complete prompts with a trained model.

    hybridtrain generate --model DIR [--adapter DIR] (--prompt TEXT | --prompts FILE.jsonl)
        [--chat] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
        [--batch-size B] [--output OUT.jsonl] [--dtype D] [--device D]
        [--speculative mtp [--draft-tokens K]]

``--model``: a Hugging Face folder, or a run folder / ``step_N`` checkpoint (its export:
``merged_hf/``, ``hf/``, or ``adapter/`` on the base recorded in the adapter; a step without an
export: its sharded checkpoint, read as ``hybridtrain convert`` reads it). ``--prompts``:
JSONL records with ``prompt`` (text) or ``messages`` (a chat, always rendered with the chat
template). ``--chat`` renders each text prompt as one user turn with the tokenizer's chat template
and its generation prompt. Greedy unless ``--temperature`` (> 0) or ``--top-k``/``--top-p`` is
given; ``--temperature 0`` is greedy whatever else is given. Out-of-range settings are refused
naming the flag, and so is a ``--max-new-tokens`` past the model's context
(``max_position_embeddings``) or whose decoding cache would not fit in the memory available
(computed before anything is allocated). Writes one JSON object per prompt (``prompt``,
``completion``, ``new_tokens``, ``tokens_per_s`` of its batch) to stdout or ``--output``.
``--speculative mtp``: greedy self-speculative decoding, the model's multi-token prediction
layers drafting ``--draft-tokens`` tokens per step and the model verifying them in one pass
(the same tokens as plain greedy decoding; one prompt at a time); each record adds
``drafted``, ``accepted`` and ``acceptance_rate``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from hybridtrain.config.dtypes import DTYPE_NAMES, to_torch_dtype
from hybridtrain.data import load_tokenizer
from hybridtrain.data.templates import apply_template
from hybridtrain.fileio import decode_utf8, given_path, json_loads, read_json, text_reader, input_file, output_file, write_error
from hybridtrain.models.spec import Decoding, get_model_spec, model_spec_for
from hybridtrain.peft.export import adapter_base_quant, load_peft_adapter
from hybridtrain.runfolder import latest_checkpoint
from hybridtrain.training.checkpoint_reader import load_checkpoint_model, read_checkpoint, step_folder
from hybridtrain.training.evaluation import left_pad

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- loading
def _read_json(path: str) -> dict:
    try:
        return read_json(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None


def resolve_export(path: str, flag: str = "--model") -> tuple[str, str | None]:
    """(Hugging Face folder, adapter folder or None) that ``path`` names: a run folder (its
    ``latest`` checkpoint), a ``step_N`` checkpoint (its export: ``merged_hf/``, ``hf/``, then
    ``adapter/``; its own ``config.json`` is the model config, not an export), an adapter folder
    or an HF folder. Errors name ``flag``, the option that gave ``path``."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: no such folder")
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
        raise ValueError(f"{flag} {path}: a checkpoint without an export (hf/, merged_hf/ or "
                         f"adapter/); write one with `hybridtrain convert {path} OUT_DIR`")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, None
    raise ValueError(f"{flag} {path}: neither a Hugging Face folder (config.json) nor a checkpoint "
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


class Loaded(NamedTuple):
    model: torch.nn.Module
    tokenizer: Any
    hf_dir: str | None  # the Hugging Face folder read (None: a step's sharded checkpoint)
    source: str  # what was read: that folder, the adapter, or the step_N checkpoint


def load_model(model_dir: str, adapter_dir: str | None = None, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu", flag: str = "--model"):
    """(model, tokenizer) for generation: the model class registered for the folder's
    ``model_type``, with a PEFT adapter applied when given (not merged); a ``step_N`` checkpoint
    without an export: the model its sharded checkpoint holds, with its tokenizer."""
    return tuple(open_model(model_dir, adapter_dir, dtype, device, flag)[:2])


def open_model(model_dir: str, adapter_dir: str | None = None,
               dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               flag: str = "--model") -> Loaded:
    """:func:`load_model`, with what it read. A run folder or checkpoint is read as
    :func:`~hybridtrain.training.checkpoint_reader.read_checkpoint` reads it: its step pinned, nothing
    written (a live run's folder too)."""
    return read_checkpoint(model_dir, lambda path: _open_model(path, adapter_dir, dtype, device, flag))


def _open_model(model_dir: str, adapter_dir: str | None, dtype, device, flag: str) -> Loaded:
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
        return Loaded(model.to(device).eval(), load_tokenizer(tok_dir), None, step_dir)
    hf_dir, found_adapter = resolve_export(model_dir, flag)
    adapter_dir = adapter_dir or found_adapter
    model_type = _read_json(os.path.join(hf_dir, "config.json")).get("model_type")
    spec = get_model_spec(str(model_type))
    spec.part(Decoding, "hybridtrain generate")  # the family generates text
    model = spec.model_cls.from_pretrained(hf_dir, dtype=dtype)
    if adapter_dir:
        # a QLoRA adapter runs on the base it was trained on: quantised the same way
        load_peft_adapter(model, adapter_dir, base_quant=adapter_base_quant(adapter_dir))
    tok_dir = adapter_dir if adapter_dir and os.path.isfile(os.path.join(adapter_dir, "tokenizer_config.json")) \
        else hf_dir
    return Loaded(model.to(device).eval(), load_tokenizer(tok_dir), hf_dir, adapter_dir or hf_dir)


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


@text_reader("prompts")
def read_prompts(path: str) -> list[dict]:
    """The prompt records of a JSONL file (errors name the file and line)."""
    path = input_file(path, "--prompts")
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = decode_utf8(raw, path, line=n, error=ValueError)
            if not line.strip():
                continue
            try:
                rec = json_loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(rec, dict) or not ({"prompt", "messages"} & rec.keys()):
                raise ValueError(f"{path}:{n}: a record needs 'prompt' (text) or 'messages' (a chat)")
            out.append(check_prompt(rec, f"{path}:{n}"))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def sampling_settings(temperature: float | None, top_k: int, top_p: float) -> dict:
    """``do_sample``/``temperature``/``top_k``/``top_p`` for ``generate`` from the flags, each
    checked (ValueError naming the flag). ``--temperature 0`` is greedy; sampling when a
    temperature > 0, ``--top-k`` > 0 or ``--top-p`` < 1 is given."""
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got "
                         f"{temperature}")
    if top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: no top-k filtering), got {top_k}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"--top-p must be in (0, 1] (1: no nucleus filtering), got {top_p}")
    if temperature == 0:
        return {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    do_sample = temperature is not None or top_k > 0 or top_p < 1.0
    return {"do_sample": do_sample, "temperature": temperature or 1.0, "top_k": top_k,
            "top_p": top_p}


def available_memory(device: torch.device) -> tuple[int, str]:
    """(bytes free for new tensors on ``device``, how it was measured)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # a cgroup (container, Slurm job) may allow less than the machine has
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            free = min(free if free is not None else 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    if free is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free, "available in host memory"


def check_generation_length(model, batch_size: int, prompt_length: int, max_new_tokens: int,
                            device: torch.device, memory_fraction: float = 0.9) -> None:
    """Refuse (ValueError naming ``--max-new-tokens`` and the numbers) a generation past the
    model's context (``config.max_position_embeddings``) or whose decoding cache (the model's
    ``generation_cache_bytes``) and output ids would take more than ``memory_fraction`` of the
    memory available, before anything is allocated."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    model_spec_for(model).part(Decoding, "hybridtrain generate")  # generate, its cache's bytes
    context = getattr(model.config, "max_position_embeddings", None)
    if context and prompt_length + max_new_tokens > context:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens}: the longest prompt ({prompt_length} tokens) plus "
            f"{max_new_tokens} new tokens exceeds the model's context of {context} tokens "
            f"(max_position_embeddings); use --max-new-tokens {max(context - prompt_length, 0)} "
            "or less")

    def need(n: int) -> int:
        length = prompt_length + n
        return model.generation_cache_bytes(batch_size, length) + batch_size * length * 8

    free, how = available_memory(device)
    budget = int(free * memory_fraction)
    if need(max_new_tokens) > budget:
        per_token = max(need(2) - need(1), 1)
        most = max((budget - need(0)) // per_token, 0)
        gib = 2 ** 30
        raise ValueError(
            f"--max-new-tokens {max_new_tokens}: the decoding cache for {batch_size} prompt(s) of "
            f"up to {prompt_length} tokens takes {need(max_new_tokens) / gib:.2f} GiB, more than "
            f"{memory_fraction:.0%} of the {free / gib:.2f} GiB {how}; use --max-new-tokens "
            f"{most} or less, or a smaller --batch-size")


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


def complete_speculative(model, tokenizer, prompts: list[list[int]], *, draft_tokens: int,
                         max_new_tokens: int, stop_ids=None) -> list[dict]:
    """As :func:`complete` (greedy), each prompt decoded on its own by the model family's
    self-speculative decoding (the spec's ``Decoding.speculative``); each record adds
    ``drafted``, ``accepted`` and ``acceptance_rate``."""
    speculative = model_spec_for(model).part(Decoding, "--speculative").speculative
    if speculative is None:
        raise ValueError(f"--speculative: the model family {model_spec_for(model).name!r} has no "
                         "speculative decoding (its spec's Decoding.speculative); drop the flag")
    device = next(model.parameters()).device
    stops, out = set(stop_ids or ()), []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        t0 = time.perf_counter()
        seq, stats = speculative(model, ids, max_new_tokens, draft_tokens, list(stops) or None)
        dt = time.perf_counter() - t0
        row = seq[0, ids.shape[1]:].tolist()
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        text_ids, n = (row, len(row)) if cut is None else (row[:cut], cut + 1)
        out.append({"completion": tokenizer.decode(text_ids, skip_special_tokens=False), "new_tokens": n,
                    "tokens_per_s": len(row) / dt if dt > 0 else None, **stats})
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
    p.add_argument("--speculative", default=None, choices=("mtp",),
                   help="greedy self-speculative decoding drafted by the model's multi-token "
                        "prediction layers")
    p.add_argument("--draft-tokens", type=int, default=3,
                   help="--speculative: tokens drafted per step (>= 1)")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    for flag in ("model", "adapter", "prompts", "output"):  # as data paths: ~ expanded
        setattr(args, flag, given_path(getattr(args, flag), f"--{flag}"))
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = sampling_settings(args.temperature, args.top_k, args.top_p)
    if args.speculative is not None:
        if sampling.get("do_sample"):
            raise ValueError("--speculative decodes greedily; drop --temperature / --top-k / --top-p")
        if args.draft_tokens < 1:
            raise ValueError(f"--draft-tokens must be >= 1, got {args.draft_tokens}")
    if args.adapter is not None and not os.path.isdir(args.adapter):
        raise ValueError(f"--adapter {args.adapter}: no such folder (a PEFT adapter folder with "
                         "adapter_config.json)")
    output = output_file(args.output, "--output") if args.output is not None else None
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    records = read_prompts(args.prompts) if args.prompts is not None else \
        [check_prompt({"prompt": args.prompt}, "--prompt")]
    model, tok, hf_dir, _ = open_model(args.model, args.adapter, dtype=args.dtype, device=device)
    if args.chat and not getattr(tok, "chat_template", None):
        raise ValueError("--chat: the tokenizer has no chat template")
    prompts = [encode_prompt(tok, r, args.chat, "--prompt" if args.prompts is None
                             else f"{args.prompts} record {i + 1}") for i, r in enumerate(records)]
    check_generation_length(model, min(args.batch_size, len(prompts)),
                            max(len(p) for p in prompts), args.max_new_tokens, device)
    stop_ids = stop_token_ids(tok, hf_dir, chat=args.chat or any("messages" in r for r in records))
    if args.speculative is not None:
        results = complete_speculative(model, tok, prompts, draft_tokens=args.draft_tokens,
                                       max_new_tokens=args.max_new_tokens, stop_ids=stop_ids)
    else:
        results = complete(model, tok, prompts, batch_size=args.batch_size, stop_ids=stop_ids,
                           max_new_tokens=args.max_new_tokens, seed=args.seed, **sampling)
    lines = "".join(json.dumps({"prompt": rec.get("prompt", rec.get("messages")), **res},
                               ensure_ascii=False) + "\n" for rec, res in zip(records, results))
    if output is None:
        sys.stdout.write(lines)
        return 0
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(lines)
    except OSError as e:
        err = write_error(e, "the completions", output)
        if err is None:
            raise ValueError(f"--output {args.output}: cannot write it ({e.strerror})") from None
        raise err from e
    logger.info("wrote %d completions to %s", len(results), output)
    return 0
