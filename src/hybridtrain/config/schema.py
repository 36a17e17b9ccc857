"""The recipe schema: every section and key a hybridtrain recipe may contain, with defaults.

**This file is the single source of truth for recipe keys.** The loader fills defaults from
here, so code reads ``cfg.training.max_steps`` without ``.get(..., default)``; a key that is not
listed here is a typo (``unknown key 'training.max_stpes' in recipe.yaml:12; did you mean
'max_steps'?``). A part of hybridtrain that needs a new key adds it here, with a default and a
one-line doc, in the section it belongs to.

Section kinds:

* ``fixed``  -- a known set of keys (``K`` entries below). Always present in the loaded config
  (filled with defaults) unless ``optional=True``, in which case an absent section is ``None``
  and a present one is filled with defaults. Sections with ``target_ok=True`` may instead be a
  ``_target_`` mapping, whose keys are then checked against the callable's signature when it is
  instantiated.
* ``open``   -- arbitrary keys, usually a ``_target_`` mapping (``model``, ``dataset``, ...).
  ``None`` when absent. Keys are checked at instantiation against the callable's signature.
* ``env``    -- ``dist_env``: names mapped to environment variables (see ``dist_env.py``).

Besides the sections, the top level may hold ``allowed_target_prefixes: [mypkg., ...]`` which
extends the ``_target_`` allow-list (see ``instantiate.py``), and keys starting with ``_`` which
are ignored (a place for YAML anchors: ``_base: &base {...}`` then ``<<: *base``).

``peft: {match_all_linear: true}`` (or ``target_modules``) enables LoRA; ``peft:`` (empty, i.e.
null) or no ``peft`` key leaves it off.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridtrain.config.dtypes import DTYPE_NAMES

__all__ = ["K", "Section", "SECTIONS", "TOP_LEVEL_KEYS", "section_defaults", "parse_duration",
           "parse_signals"]


@dataclass(frozen=True)
class K:
    """One key of a fixed section.

    ``types``: accepted Python types; ``None`` means "the type of the default" (no check when
    the default is ``None``). ``int`` is accepted where ``float`` is. ``choices``: allowed values
    for strings (matched case-insensitively and normalised to the spelling given here).
    ``minimum``: the smallest number accepted (checked when the recipe is loaded, so before
    anything is built, and by ``--print-config``). ``path``: the value, when a string, is a
    path the user gives (``"file"`` or ``"folder"``): an empty or blank one is refused naming the
    key and where it was set, and ``~`` is expanded, as for data paths.
    """

    default: Any
    doc: str = ""
    types: tuple[type, ...] | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None  # numbers below it are refused (null stays allowed)
    env: str | None = None  # an environment variable that, when set, replaces the default
    path: str | None = None  # "file" | "folder": a path the user gives


@dataclass(frozen=True)
class Section:
    name: str
    kind: str  # "fixed" | "open" | "env"
    doc: str
    keys: dict[str, K] = field(default_factory=dict)
    optional: bool = False
    target_ok: bool = False
    # a rule over the section's keys together: (validated section) -> None, or (the key to
    # point at, the problem)
    check: Callable[[dict[str, Any]], tuple[str, str] | None] | None = None


_OPT_INT = (int, type(None))
_OPT_FLOAT = (float, int, type(None))
_OPT_STR = (str, type(None))

TRAINING = {
    "global_batch_size": K(8, "samples per optimizer step, over all data-parallel ranks", (int,), minimum=1),
    "micro_batch_size": K(1, "samples per forward/backward on one rank; gradient "
                             "accumulation = global / (micro * data-parallel size)", (int,), minimum=1),
    "max_steps": K(None, "optimizer steps to run; null -> derived from num_epochs", _OPT_INT, minimum=1),
    "num_epochs": K(1, "epochs over the dataset when max_steps is null", (int, float)),
    "val_every_steps": K(None, "validate every N steps; null or 0 -> only at the end "
                               "(if a validation_dataset is given)", _OPT_INT, minimum=0),
    "max_val_steps": K(None, "cap on validation batches per validation; null -> whole set",
                       _OPT_INT, minimum=1),
    "val_micro_batch_size": K(None, "validation batch per rank; null -> micro_batch_size",
                              _OPT_INT, minimum=1),
    "val_accuracy": K(False, "also report teacher-forced answer_accuracy / token_accuracy at "
                             "validation (one more forward per batch, full logits)"),
    "ckpt_every_steps": K(None, "checkpoint every N steps; null or 0 -> only at the end",
                          _OPT_INT, minimum=0),
    "log_every_steps": K(1, "write training.jsonl / progress every N steps", (int,), minimum=1),
    "seed": K(42, "global seed (model init, data order, dropout)", (int,)),
    "dtype": K("auto", "compute dtype (master weights and optimizer state stay float32; "
                       "bfloat16 runs under autocast); auto -> bfloat16 on CUDA and on CPUs with "
                       "native bf16 matmul (avx512_bf16/amx_bf16), else float32; float16 is "
                       "refused (needs loss scaling)",
               choices=("auto", *DTYPE_NAMES)),
    "device": K("auto", "auto -> cuda when available else cpu", choices=("auto", "cpu", "cuda")),
    "cpu_allocator": K("auto", "glibc malloc for CPU training: heap -> freed large blocks are "
                               "reused (far fewer page faults per step; resident memory stays with the "
                               "process), system -> glibc defaults; auto -> heap on CPU, else system "
                               "(ops/backend.py)",
                       choices=("auto", "heap", "system")),
    "cpu_bf16": K("auto", "whether this CPU's bf16 matmuls are fast, for dtype: auto; auto -> CPU "
                          "flags (avx512_bf16/amx_bf16), else a timed matmul probe; true/false "
                          "override the detection (ops/backend.py)", (bool, str)),
    "grouped_mm": K("auto", "CUDA bf16 MoE experts through torch grouped_mm: auto -> where torch "
                            "has it (a CUDA run without it, or not in bf16, warns); true -> a run "
                            "that cannot use it refuses; false -> a loop over experts "
                            "(ops/backend.py)", (bool, str), choices=("auto",)),
    "float8": K(None, "train the blocks' Linear layers in float8 through torchao (extra "
                      "hybridtrain[quant]): tensorwise or rowwise scales; null -> off. Weights, "
                      "checkpoints and exports stay high-precision (training/float8.py)",
                (str, type(None)), choices=("tensorwise", "rowwise")),
    "float8_filter": K(None, "regular expressions: Linear layers whose names match stay "
                             "high-precision under float8; null -> the first and last block",
                       (list, type(None))),
    "fused_loss": K("auto", "the linear cross-entropy's implementation: torch (chunked PyTorch "
                            "loop), compiled (its chunk functions under torch.compile), liger "
                            "(Liger-Kernel's fused Triton kernel, extra hybridtrain[cuda]); auto -> "
                            "liger on CUDA where it imports, else compiled on CUDA, torch on CPU "
                            "(ops/backend.py)", choices=("auto", "torch", "compiled", "liger")),
    "mamba_kernels": K("auto", "Mamba2 through the mamba_ssm / causal_conv1d CUDA kernels: auto -> "
                               "where they import, for CUDA tensors (a CUDA run without them warns); "
                               "true -> always (a missing package refuses the run; on CPU only under "
                               "TRITON_INTERPRET=1); false -> the PyTorch path "
                               "(ops/backend.py); the environment variable "
                               "HYBRIDTRAIN_MAMBA_KERNELS (auto, 1, 0) sets the default",
                       (bool, str), choices=("auto",), env="HYBRIDTRAIN_MAMBA_KERNELS"),
    "loss_chunk_size": K("auto", "tokens per chunk of the linear cross-entropy (logits never "
                                 "materialised whole); auto -> 2^25 logits per chunk (128 MiB in "
                                 "fp32): 1024 tokens at a 32k vocabulary, 256 at 131k; null -> "
                                 "plain full-logit loss", (int, str, type(None)), choices=("auto",)),
    "max_consecutive_skipped_steps": K(5, "stop the run (non-zero exit, no export) after this "
                                          "many skipped steps in a row (non-finite loss or "
                                          "gradient norm); null or 0 -> never stop", _OPT_INT,
                                          minimum=0),
    "grad_clip": K(1.0, "max global gradient norm; null or 0 disables clipping", _OPT_FLOAT, minimum=0),
    "activation_checkpointing": K(False, "recompute block activations in backward: true/false, "
                                         "'all', k (every k-th block), layer types "
                                         "['mamba', 'moe'] (see distributed/activation_checkpoint)",
                                  (bool, int, str, list, dict)),
    "compile": K("auto", "torch.compile each block (distributed/compile.py); auto -> on CUDA, off "
                         "on CPU", (bool, str), choices=("auto",)),
    "deterministic": K(False, "torch.use_deterministic_algorithms + deterministic kernels"),
    "gc_every_steps": K(None, "run gc.collect() every N steps (null: Python default)",
                        _OPT_INT),
    "max_time": K(None, "wall-clock limit of the run, e.g. '3h50m', '45m', '90s' (units d, h, "
                        "m, s): the run saves a checkpoint and exits 75 early enough for the save "
                        "to finish before it; null -> no limit", (str, int, float, type(None))),
}

DATALOADER = {
    "shuffle": K(True, "shuffle the training set each epoch (seeded by training.seed)"),
    "num_workers": K(0, "torch DataLoader workers", (int,), minimum=0),
    "drop_last": K(True, "drop the last incomplete global batch of an epoch"),
    "pin_memory": K(True, "pin host memory when training on GPU"),
}

PACKING = {
    "enabled": K(False, "pack several examples per sequence (document-masked, no leakage)"),
    "pack_size": K(2048, "tokens per packed sequence", (int,), minimum=2),
    "split_across_pack": K(False, "split an example that does not fit instead of moving it "
                                  "to the next pack"),
    "max_packs": K(None, "cap on the number of packs built (null: all)", _OPT_INT, minimum=1),
    "pad_to_multiple_of": K(1, "pad each document in a pack to a multiple of this",
                            (int,)),
}

OPTIMIZER = {
    "name": K("adamw", "optimizer (AdamW; norms and biases get no weight decay)",
              choices=("adamw",)),
    "lr": K(1e-4, "peak learning rate", (float, int), minimum=0),
    "weight_decay": K(0.0, "decoupled weight decay (not applied to norms/biases)", (float, int), minimum=0),
    "betas": K([0.9, 0.999], "Adam betas", (list, tuple)),
    "eps": K(1e-8, "Adam epsilon", (float, int), minimum=0),
    "implementation": K("auto", "auto -> fused when torch has it for the device (CUDA and CPU), else foreach",
                        choices=("auto", "fused", "foreach", "for_loop")),
}

LR_SCHEDULER = {
    "lr_decay_style": K("constant", "shape after warmup",
                        choices=("constant", "linear", "cosine", "wsd")),
    "lr_warmup_steps": K(0, "linear warmup length in optimizer steps", (int,), minimum=0),
    "lr_warmup_samples": K(None, "warmup length in samples (instead of lr_warmup_steps)",
                           _OPT_INT),
    "lr_decay_steps": K(None, "steps from start to end of decay; null -> max_steps", _OPT_INT),
    "lr_decay_samples": K(None, "decay length in samples (instead of lr_decay_steps)",
                          _OPT_INT),
    "lr_wsd_decay_style": K("linear", "WSD: shape of the final decay phase",
                            choices=("linear", "cosine", "minus_sqrt")),
    "lr_wsd_decay_steps": K(None, "WSD: length of the final decay phase in steps; "
                                  "null -> 10% of the decay length", _OPT_INT),
    "lr_wsd_decay_samples": K(None, "WSD: decay phase length in samples", _OPT_INT),
    "init_lr": K(0.0, "learning rate at the start of warmup", (float, int)),
    "min_lr": K(0.0, "learning rate at the end of decay", (float, int), minimum=0),
}

CHECKPOINT = {
    "dir": K("outputs/run", "the run's output folder: training.jsonl, validation.jsonl, "
                            "step_{N}/, latest, loss.png", (str,), path="folder"),
    "enabled": K(True, "write step_{N}/ checkpoints (every ckpt_every_steps and at the end)"),
    "resume": K(None, "null: start fresh; auto: resume from <dir>/latest if present; "
                      "or a path to a step_{N} folder", (str, bool, type(None)), path="folder"),
    "overwrite": K(False, "with resume null, start over in a checkpoint.dir that holds an earlier "
                          "run's step_{N}/ (deleting them); false -> refuse with an error"),
    "keep_last": K(None, "keep only the newest K step_{N}/ folders (null: keep all)", _OPT_INT,
                   minimum=1),
    "save_hf_at_end": K(True, "write a consolidated HF export (hf/ or adapter/) at the end"),
    "save_hf_every": K(False, "also write the HF export inside every step_{N}/"),
    "save_dtype": K("auto", "dtype of the HF export (hf/, convert); step_{N}/ always keeps the "
                            "float32 masters. auto -> the dtype the weights were loaded from "
                            "(bfloat16 for a bf16 Hub checkpoint), else the parameter dtype",
                    choices=("auto", *DTYPE_NAMES)),
    "save_merged_hf": K(False, "LoRA: also write a merged full-weight HF dir (merged_hf/)"),
    "save_on_signal": K(["SIGTERM", "SIGUSR1"], "signals that stop the run at the next step "
                                                "boundary with a checkpoint and exit 75 (resume "
                                                "with checkpoint.resume: auto); [] -> the "
                                                "signals' default action", (list,)),
}

PEFT = {
    "method": K("lora", "PEFT method", choices=("lora",)),
    "dim": K(8, "LoRA rank", (int,), minimum=1),
    "alpha": K(32, "LoRA alpha (scale = alpha / dim)", (int, float)),
    "dropout": K(0.0, "dropout on the LoRA input", (float, int)),
    "target_modules": K([], "glob patterns of module names to adapt (e.g. '*.q_proj')",
                        (list,)),
    "exclude_modules": K([], "glob patterns of module names never adapted", (list,)),
    "match_all_linear": K(False, "adapt every linear layer (except lm_head/embeddings)"),
}



_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> float:
    """Seconds of a duration written with units, largest first: ``"3h50m"``, ``"45m"``,
    ``"90s"``, ``"1d2h"``, ``"1.5h"``; ValueError for anything else (a bare number is refused:
    its unit would be a guess)."""
    s = str(text).strip().lower().replace(" ", "")
    parts = _DURATION_RE.findall(s)
    units = [u for _, u in parts]
    if (not parts or "".join(n + u for n, u in parts) != s or len(set(units)) != len(units)
            or units != sorted(units, key=lambda u: -_SECONDS[u])):
        raise ValueError(f"{text!r} is not a duration: write it with units, largest first, "
                         f"e.g. '3h50m', '45m', '90s' or '1d2h'")
    seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"{text!r}: a time limit must be longer than 0s")
    return seconds


def parse_signals(names: list) -> list[int]:
    """Signal numbers of ``['SIGTERM', 'USR1', ...]`` (with or without the SIG prefix, any
    case); ValueError naming a name this system does not have or one that cannot be caught."""
    import signal

    out = []
    for name in names:
        key = str(name).strip().upper()
        key = key if key.startswith("SIG") else "SIG" + key
        sig = getattr(signal, key, None)
        if not isinstance(sig, signal.Signals) or key.startswith("SIG_") or \
                sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{name!r} is not a signal a run can catch (e.g. SIGTERM, SIGUSR1, "
                             f"SIGUSR2, SIGINT)")
        out.append(int(sig))
    return out


def _check_training(training: dict[str, Any]) -> tuple[str, str] | None:
    if training["max_time"] is not None:
        try:
            parse_duration(training["max_time"])
        except ValueError as e:
            return "max_time", f"training.max_time: {e}"
    return None


def _check_checkpoint(checkpoint: dict[str, Any]) -> tuple[str, str] | None:
    try:
        parse_signals(checkpoint["save_on_signal"])
    except ValueError as e:
        return "save_on_signal", f"checkpoint.save_on_signal: {e}"
    return None


def _check_evaluation(evaluation: dict[str, Any]) -> tuple[str, str] | None:
    t, p = evaluation["temperature"], evaluation["top_p"]
    if not (t == t and abs(t) != float("inf") and t >= 0):  # t == t: not NaN
        return "temperature", f"evaluation.temperature must be a finite number >= 0, got {t!r}"
    if evaluation["do_sample"] and t == 0:
        return "temperature", ("evaluation.temperature 0 with do_sample: true; temperature 0 is "
                               "greedy decoding: set do_sample: false (or a temperature > 0)")
    if not 0 < p <= 1:
        return "top_p", f"evaluation.top_p must be in (0, 1] (1.0: all), got {p!r}"
    return None


def _check_peft(peft: dict[str, Any]) -> tuple[str, str] | None:
    if not peft["match_all_linear"] and not peft["target_modules"]:
        return "match_all_linear", (
            "peft.match_all_linear is false and peft.target_modules is empty: nothing says which "
            "layers to adapt. Set peft.match_all_linear: true (every linear layer but lm_head, "
            "and the MoE experts) or list peft.target_modules (globs, e.g. ['*.q_proj'])")
    return None


DISTRIBUTED = {
    "backend": K("auto", "auto -> nccl on GPU, gloo on CPU", choices=("auto", "nccl", "gloo")),
    "dp_replicate": K(1, "data-parallel replicas (HSDP outer dim)", (int,)),
    "dp_shard": K(-1, "FSDP shard degree; -1 -> whatever the other degrees leave", (int,)),
    "cp": K(1, "context-parallel degree", (int,)),
    "tp": K(1, "tensor-parallel degree", (int,)),
    "pp": K(1, "pipeline-parallel degree", (int,)),
    "ep": K(1, "expert-parallel degree (borrowed from dp_shard*cp)", (int,)),
    "encoder_ranks": K(0, "heterogeneous layout: the model's encoder (vision + projector) on "
                          "ranks 0..E-1, the rest on the others; 0 -> every module on every "
                          "rank", (int,), minimum=0),
    "ep_backend": K("alltoall", "expert token dispatch: torch all-to-all, or DeepEP (CUDA)",
                    choices=("alltoall", "deepep")),
    "pp_schedule": K("1f1b", "pipeline schedule: 1f1b, gpipe, interleaved1f1b, loopedbfs, "
                             "interleavedzb, zbv, dualpipev (case and '_' insensitive)", (str,)),
    "pp_stages_per_rank": K(None, "stages per rank for interleaved / V schedules; null -> 2 for "
                                  "those, else 1", _OPT_INT),
    "pp_microbatch_size": K(None, "rows per pipeline micro-batch; null -> the trainer's "
                                  "micro-batches (same micro-batching as one process)", _OPT_INT),
    "pp_split_points": K(None, "manual split: first layer index of every stage after the first; "
                               "null -> balanced by per-layer FLOPs", (list, type(None))),
    "sequence_parallel": K(False, "with tp > 1: the residual stream and the norms hold each tp "
                                  "rank's 1/tp of every row; the mixers gather whole rows (their "
                                  "saved inputs keep 1/tp, gathered again in backward). No "
                                  "effect with tp: 1"),
    "fsdp_reshard_after_forward": K("default", "FSDP2 reshard policy (default: reshard, except "
                                               "under pp; always: under pp each unit also "
                                               "reshards after its backward, less memory)",
                                    choices=("default", "always", "never")),
    "fsdp_backward_prefetch": K(True, "FSDP2 all-gathers the next unit of backward while one "
                                      "computes; false: one unit at a time (less memory, no "
                                      "overlap)"),
    "fsdp_param_dtype": K("auto", "FSDP2 all-gather/compute dtype; auto -> training dtype",
                          choices=("auto", "float32", "bfloat16")),
    "fsdp_reduce_dtype": K("float32", "gradient reduce-scatter dtype",
                           choices=("float32", "bfloat16")),
    "cpu_offload": K(False, "FSDP2 CPU offload of parameters/optimizer state"),
    "timeout_seconds": K(1800, "process-group timeout", (int,), minimum=1),
}

METRICS = {
    "jsonl": K(True, "write <checkpoint.dir>/training.jsonl and validation.jsonl"),
    "progress_bar": K(True, "rank-0 tqdm bar (loss, lr, tokens/s, ETA)"),
    "tensorboard": K(False, "write TensorBoard events (needs the tb extra)"),
    "tensorboard_dir": K(None, "null -> <checkpoint.dir>/tb", _OPT_STR, path="folder"),
    "plot": K(True, "write <checkpoint.dir>/loss.png at the end (needs the plot extra)"),
    "peak_tflops": K(None, "per-device peak TFLOPs for MFU; null -> detect from device name",
                     _OPT_FLOAT),
}

BENCHMARK = {
    "data": K("synthetic", "synthetic: random tokens in rows of seq_len; recipe: the recipe's "
                           "dataset (tokenizer, packing and batch sizes)",
              choices=("synthetic", "recipe")),
    "seq_len": K(None, "synthetic row length; null -> packing.pack_size when packing is on, else "
                       "the dataset's seq_length, else 2048", _OPT_INT),
    "doc_length": K(None, "synthetic: split each row into documents of this many tokens (the "
                          "packed-sequence path, cu_seqlens); null -> one document per row",
                    _OPT_INT),
    "tokens_per_step": K(None, "synthetic: rows per step = tokens_per_step / seq_len (per rank, "
                               "one micro-batch); null -> global_batch_size / dp * seq_len",
                         _OPT_INT),
    "warmup_steps": K(2, "steps run before timing", (int,), minimum=0),
    "steps": K(5, "timed steps", (int,), minimum=1),
    "seq_lengths": K([512, 2048, 8192], "cost growth: the synthetic measurement repeated at each "
                                        "length with the same tokens per step ([] to skip)",
                     (list, type(None))),
    "dtypes": K(None, "compute dtypes to compare, e.g. [float32, bfloat16] (single process "
                      "only); null -> training.dtype", (list, type(None))),
    "profile": K(False, "true or a folder: torch profiler trace (Chrome/Perfetto JSON) of "
                        "profile_steps steps after the timed ones", (bool, str), path="folder"),
    "profile_steps": K(2, "steps traced when profile is on", (int,), minimum=1),
    "measure_peak": K(False, "also measure the device's matmul peak (an n x n matmul) and report "
                             "MFU against it"),
    "output": K(None, "results JSON file; null -> <checkpoint.dir>/benchmark.json", _OPT_STR,
                path="file"),
}

RL = {
    "sequence_packing": K(False, "Policy: pack each micro-batch's rows into one row of documents "
                                 "(no padding computed; targets never cross a document)"),
    "micro_batch_size": K(None, "Policy: rows per forward/backward on one rank; null -> "
                                "training.micro_batch_size", _OPT_INT, minimum=1),
    "pad_to_multiple_of": K(1, "Policy: pad each packed row to a multiple of this", (int,),
                            minimum=1),
}

DPO = {
    "reference_policy_kl_penalty": K(0.05, "DPO beta", (float, int)),
    "preference_loss_weight": K(1.0, "weight of the preference term", (float, int)),
    "sft_loss_weight": K(0.0, "weight of the NLL of the chosen responses", (float, int)),
    "preference_average_log_probs": K(False, "average (not sum) the log-probs of a response"),
}

GRPO = {
    "num_prompts_per_step": K(8, "prompts per step", (int,), minimum=1),
    "num_generations_per_prompt": K(8, "samples per prompt (the group of the advantages)",
                                    (int,), minimum=1),
    "max_new_tokens": K(8, "generated tokens per sample", (int,), minimum=1),
    "temperature": K(1.0, "sampling temperature of the rollouts", (float, int)),
    "ratio_clip_min": K(0.2, "PPO epsilon below 1", (float, int)),
    "ratio_clip_max": K(0.2, "PPO epsilon above 1", (float, int)),
    "ratio_clip_c": K(None, "dual-clip constant (> 1); null: off", _OPT_FLOAT),
    "reference_policy_kl_penalty": K(0.01, "KL coefficient beta to the frozen reference",
                                     (float, int)),
    "kl_type": K("k3", "KL estimator", choices=("k1", "k2", "k3")),
    "token_level_loss": K(True, "normalise by tokens (false: by sequences)"),
    "normalize_rewards": K(True, "divide the group-centred rewards by the group's std"),
    "updates_per_rollout": K(2, "optimizer steps per batch of rollouts (its prompt groups split "
                                "evenly; after the first the policy is off the sampling one: "
                                "ratio and clipping at work)", (int,), minimum=1),
    "task": K({}, "the verifiable task: a _target_ mapping building a task object "
                  "(prompts(n, rng), reward(prompt, completion)); {} -> hybridtrain.rl.tasks."
                  "CountingTask", (dict,)),
}

EVALUATION = {
    "num_examples": K(32, "validation examples answered by generation at each validation "
                          "(the first N of validation_dataset)", (int,), minimum=1),
    "max_new_tokens": K(32, "tokens generated per answer at most (a reply also stops at eos or "
                            "the reference's end-of-turn token)", (int,), minimum=1),
    "batch_size": K(8, "prompts generated together (left-padded)", (int,), minimum=1),
    "do_sample": K(False, "sample instead of greedy decoding (the metrics use what is generated)"),
    "temperature": K(1.0, "sampling temperature (do_sample)", (float,)),
    "top_k": K(0, "sampling: keep the k most likely tokens (0: all)", (int,), minimum=0),
    "top_p": K(1.0, "sampling: nucleus probability (1.0: all)", (float,), minimum=0),
    "seed": K(0, "sampling seed (the same replies at every validation for the same weights)",
              (int,)),
    "num_samples": K(4, "replies written to samples_file at each validation (prompt, reply, "
                        "reference); 0: none", (int,), minimum=0),
    "samples_file": K("samples.jsonl", "file in checkpoint.dir the sample replies are appended to",
                      (str,), path="file"),
}

SECTIONS: dict[str, Section] = {s.name: s for s in [
    Section("model", "open", "the model: a _target_ mapping"),
    Section("tokenizer", "open", "the tokenizer: a _target_ mapping"),
    Section("dataset", "open", "the training dataset: a _target_ mapping"),
    Section("validation_dataset", "open", "the validation dataset (optional)"),
    Section("dataloader", "fixed", "data-loader options", DATALOADER),
    Section("packing", "fixed", "sequence packing", PACKING),
    Section("training", "fixed", "batch sizes, lengths, intervals, seed, dtype, clipping",
            TRAINING, check=_check_training),
    Section("optimizer", "fixed", "AdamW settings (or a _target_ mapping)", OPTIMIZER,
            target_ok=True),
    Section("lr_scheduler", "fixed", "warmup + constant/linear/cosine/WSD decay", LR_SCHEDULER,
            target_ok=True),
    Section("checkpoint", "fixed", "output folder, checkpoints, resume, HF export", CHECKPOINT,
            check=_check_checkpoint),
    Section("peft", "fixed", "LoRA (absent -> full fine-tuning)", PEFT, optional=True,
            check=_check_peft),
    Section("distributed", "fixed", "parallel layout and process-group options", DISTRIBUTED),
    Section("metrics", "fixed", "jsonl / progress bar / TensorBoard / plot", METRICS),
    Section("dist_env", "env", "environment variables set before CUDA/process-group init "
            "(key upper-cased; true/false -> 1/0; a variable already set wins)"),
    Section("evaluation", "fixed", "answers generated for validation examples at each validation: "
            "SQuAD exact match / F1 and sample replies in validation.jsonl (absent -> off)",
            EVALUATION, optional=True, check=_check_evaluation),
    Section("benchmark", "fixed", "options of `hybridtrain benchmark`; finetune ignores them",
            BENCHMARK, optional=True),
    Section("rl", "fixed", "the RL Policy's batch layout (hybridtrain.rl.Policy)", RL),
    Section("dpo", "fixed", "options of `hybridtrain dpo`", DPO),
    Section("grpo", "fixed", "options of `hybridtrain grpo`", GRPO),
]}

# Top-level keys that are not sections.
TOP_LEVEL_KEYS: dict[str, K] = {
    "allowed_target_prefixes": K([], "extra module prefixes allowed in _target_ "
                                     "(besides hybridtrain., torch.nn., torch.optim.)",
                                 (list,)),
}


def section_defaults(name: str) -> dict[str, Any]:
    """A fresh dict of the defaults of a fixed section (lists copied; a key's ``env`` variable,
    when set, replaces its default as a YAML scalar)."""
    import copy

    out = {}
    for k, spec in SECTIONS[name].keys.items():
        text = os.environ.get(spec.env) if spec.env else None
        out[k] = copy.deepcopy(spec.default) if text is None else _env_scalar(text)
    return out


def _env_scalar(text: str) -> Any:
    """An environment variable's value as a recipe scalar ("0"/"1" as false/true)."""
    import yaml

    value = yaml.safe_load(text) if text.strip() else None
    return {0: False, 1: True}.get(value, value) if isinstance(value, int) else value
