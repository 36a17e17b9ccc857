"""The recipe: every section and key a hybridtrain recipe may hold, as one tree of dataclasses.

**This file is the one place a recipe key is written**: its type (the annotation), default,
one-line doc, range or choices and unit (:func:`~hybridtrain.config.recipe_fields.key`). The
loader fills the defaults from here and refuses what does not fit (an unknown key with the
nearest one, ``unknown key 'training.max_stpes' in recipe.yaml:12; did you mean
'max_steps'?``; a value outside its range, naming the key, the line and the range); the docs'
reference page and ``hybridtrain --help`` are written from here. A section is made in code with
its defaults (``TrainingSection(max_steps=3)``) and checked as a loaded one is.

To add a key: add a field to its section class below with ``key(default, doc, range=...,
unit=...)``; read it as ``recipe.<section>.<key>`` (docs/architecture.md, "Adding a recipe key").

Sections (the fields of :class:`RecipeConfig`): ``fixed`` ones are the classes below (present
with their defaults when absent; ``optional`` ones are None when absent; ``target_ok`` ones may
instead be a ``_target_`` mapping, checked against the callable's signature when it is built);
``open`` ones hold any keys, usually a ``_target_`` mapping (``model``, ``dataset``, ...);
``dist_env`` maps names to environment variables (``dist_env.py``). The top level also holds
``allowed_target_prefixes`` and keys starting with ``_``, which are ignored (a place for YAML
anchors: ``_base: &base {...}`` then ``<<: *base``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from hybridtrain.config.dtypes import DTYPE_NAMES
from hybridtrain.config.node import ConfigNode
from hybridtrain.config.recipe_fields import (Range, RecipeSection, env_section, key,
                                              keys_of, open_section, section, sections_of)
from hybridtrain.config.text_values import parse_duration, parse_signals

__all__ = [
    "DataloaderSection", "PackingSection", "TrainingSection", "OptimizerSection",
    "LRSchedulerSection", "CheckpointSection", "PeftSection", "DistributedSection",
    "MetricsSection", "EvaluationSection", "BenchmarkSection", "RLSection", "DPOSection",
    "GRPOSection", "RecipeConfig", "RecipeSection", "SECTIONS", "SECTION_TYPES",
    "TOP_LEVEL_KEYS",
]

dataclass = dataclasses.dataclass(frozen=True)
AT_LEAST_0, AT_LEAST_1, ABOVE_0 = "[0, inf)", "[1, inf)", "(0, inf)"
SEED = Range(0, 2**63 - 1)  # what torch.manual_seed takes, with room for seed + epoch


def _unreadable(section: RecipeSection, name: str, parse) -> tuple[str, str] | None:
    """(the key, why) when ``parse`` refuses the text value of ``section.name``, else None."""
    try:
        parse(getattr(section, name))
    except ValueError as e:
        return name, f"{section.section}.{name}: {e}"
    return None


@dataclass
class DataloaderSection(RecipeSection):
    """``dataloader:``: data-loader options."""

    section: ClassVar[str] = "dataloader"
    shuffle: bool = key(True, "shuffle the training set each epoch (seeded by training.seed)")
    num_workers: int = key(0, "torch DataLoader workers", range=AT_LEAST_0, unit="processes")
    drop_last: bool = key(True, "drop the last incomplete global batch of an epoch")
    pin_memory: bool = key(True, "pin host memory when training on GPU")


@dataclass
class PackingSection(RecipeSection):
    """``packing:``: sequence packing."""

    section: ClassVar[str] = "packing"
    enabled: bool = key(False, "pack several examples per sequence (document-masked, no "
                               "leakage)")
    pack_size: int = key(2048, "tokens per packed sequence", range="[2, inf)", unit="tokens")
    split_across_pack: bool = key(False, "split an example that does not fit instead of "
                                         "moving it to the next pack")
    max_packs: int | None = key(None, "cap on the number of packs built (null: all)",
                                range=AT_LEAST_1, unit="packs")
    pad_to_multiple_of: int = key(1, "pad each document in a pack to a multiple of this",
                                  range=AT_LEAST_1, unit="tokens")
    padding_free: bool = key(False, "each micro-batch's packed rows joined into one row of their "
                                    "documents, without the rows' trailing padding (no pad token "
                                    "computed; the length changes from batch to batch)")


@dataclass
class TrainingSection(RecipeSection):
    """``training:``: batch sizes, lengths, intervals, seed, dtype, clipping."""

    section: ClassVar[str] = "training"
    global_batch_size: int = key(8, "samples per optimizer step, over all data-parallel ranks",
                                 range=AT_LEAST_1, unit="samples")
    micro_batch_size: int = key(1, "samples per forward/backward on one rank; gradient "
                                   "accumulation = global / (micro * data-parallel size)",
                                range=AT_LEAST_1, unit="samples")
    max_steps: int | None = key(None, "optimizer steps to run; null -> derived from num_epochs",
                                range=AT_LEAST_1, unit="steps")
    num_epochs: int | float = key(1, "epochs over the dataset when max_steps is null",
                                  range=ABOVE_0, unit="epochs")
    val_every_steps: int | None = key(None, "validate every N steps; null or 0 -> only at the "
                                            "end (if a validation_dataset is given)",
                                      range=AT_LEAST_0, unit="steps")
    max_val_steps: int | None = key(None, "cap on validation batches per validation; null -> "
                                          "whole set", range=AT_LEAST_1, unit="batches")
    val_micro_batch_size: int | None = key(None, "validation batch per rank; null -> "
                                                 "micro_batch_size",
                                           range=AT_LEAST_1, unit="samples")
    val_accuracy: bool = key(False, "also report teacher-forced answer_accuracy / "
                                    "token_accuracy at validation (one more forward per batch, "
                                    "full logits)")
    ckpt_every_steps: int | None = key(None, "checkpoint every N steps; null or 0 -> only at "
                                             "the end", range=AT_LEAST_0, unit="steps")
    log_every_steps: int = key(1, "write training.jsonl / progress every N steps",
                               range=AT_LEAST_1, unit="steps")
    seed: int = key(42, "global seed (model init, data order, dropout)", range=SEED)
    dtype: str = key("auto", "compute dtype (master weights and optimizer state stay float32; "
                             "bfloat16 runs under autocast); auto -> bfloat16 on CUDA and on "
                             "CPUs with native bf16 matmul (avx512_bf16/amx_bf16), else "
                             "float32; float16 is refused (needs loss scaling)",
                     choices=("auto", *DTYPE_NAMES))
    device: str = key("auto", "auto -> cuda when available else cpu",
                      choices=("auto", "cpu", "cuda"))
    cpu_allocator: str = key("auto", "glibc malloc for CPU training: heap -> freed large blocks "
                                     "are reused (far fewer page faults per step; resident "
                                     "memory stays with the process), system -> glibc defaults; "
                                     "auto -> heap on CPU, else system (ops/backend.py)",
                             choices=("auto", "heap", "system"))
    cpu_bf16: bool | str = key("auto", "whether this CPU's bf16 matmuls are fast, for dtype: "
                                       "auto; auto -> CPU flags (avx512_bf16/amx_bf16), else a "
                                       "timed matmul probe; true/false override the detection "
                                       "(ops/backend.py)")
    grouped_mm: bool | str = key(
        "auto", "CUDA bf16 MoE experts through torch grouped_mm: auto -> where torch has it (a "
                "CUDA run without it, or not in bf16, warns); true -> a run that cannot use it "
                "refuses; false -> a loop over experts (ops/backend.py)", choices=("auto",))
    float8: str | None = key(
        None, "train the blocks' Linear layers in float8 through torchao (extra "
              "hybridtrain[quant]): tensorwise or rowwise scales (tensorwise under FSDP2: "
              "float8 all-gather); on CUDA also the routed experts (torchao's rowwise float8 "
              "grouped GEMM); null -> off. Weights, checkpoints and exports stay "
              "high-precision (training/float8.py)",
        choices=("tensorwise", "rowwise"))
    float8_filter: list[str] | None = key(
        None, "regular expressions: Linear layers and expert modules whose names match stay "
              "high-precision under float8; null -> the first and last block")
    fused_loss: str = key("auto", "the linear cross-entropy's implementation: torch (chunked "
                                  "PyTorch loop), compiled (its chunk functions under "
                                  "torch.compile), liger (Liger-Kernel's fused Triton kernel, "
                                  "extra hybridtrain[cuda]); auto -> liger on CUDA where it "
                                  "imports, else compiled on CUDA, torch on CPU (ops/backend.py)",
                          choices=("auto", "torch", "compiled", "liger"))
    mamba_kernels: bool | str = key(
        "auto", "Mamba2 through the mamba_ssm / causal_conv1d CUDA kernels: auto -> where they "
                "import, for CUDA tensors (a CUDA run without them warns); true -> always (a "
                "missing package refuses the run; on CPU only under TRITON_INTERPRET=1); false "
                "-> the PyTorch path (ops/backend.py); the environment variable "
                "HYBRIDTRAIN_MAMBA_KERNELS (auto, 1, 0) sets the default",
        choices=("auto",), env="HYBRIDTRAIN_MAMBA_KERNELS")
    loss_chunk_size: int | str | None = key(
        "auto", "tokens per chunk of the linear cross-entropy (logits never materialised "
                "whole); auto -> 2^25 logits per chunk (128 MiB in fp32): 1024 tokens at a 32k "
                "vocabulary, 256 at 131k; null -> plain full-logit loss",
        choices=("auto",), range=AT_LEAST_1, unit="tokens")
    max_consecutive_skipped_steps: int | None = key(
        5, "stop the run (non-zero exit, no export) after this many skipped steps in a row "
           "(non-finite loss or gradient norm); null or 0 -> never stop",
        range=AT_LEAST_0, unit="steps")
    grad_clip: float | None = key(1.0, "max global gradient norm; null or 0 disables clipping",
                                  range=AT_LEAST_0)
    mtp: str = key("train", "the model's multi-token prediction layers (a config.json with "
                            "num_nextn_predict_layers): train (their loss beside the LM loss), "
                            "freeze (kept and exported unchanged, not trained), drop (left out of "
                            "training and of the export); logged at start",
                   choices=("train", "freeze", "drop"))
    mtp_loss_scale: float = key(0.1, "weight of the multi-token prediction loss, averaged over "
                                     "the MTP depths (Megatron-Bridge's mtp_loss_scaling_factor); "
                                     "each depth's CE is normalised by the global count of its "
                                     "supervised positions", range=AT_LEAST_0)
    moe_bias_update_rate: float = key(
        0.0, "aux-loss-free balancing: after each optimizer step every MoE router's "
             "e_score_correction_bias moves by this much toward its under-loaded experts (sign "
             "of mean load - load, counts summed over all ranks; Megatron's "
             "moe_router_bias_update_rate, e.g. 1e-3); 0 -> never updated", range=AT_LEAST_0)
    moe_aux_loss_coeff: float = key(
        0.0, "sequence-level auxiliary balance loss of the MoE routers (DeepSeek-V3 / Megatron "
             "seq_aux_loss), summed over layers, per row, with this weight; logged as "
             "moe_aux_loss; 0 -> off", range=AT_LEAST_0)
    activation_checkpointing: bool | int | str | list | dict = key(
        False, "recompute block activations in backward: true/false, 'all', k (every k-th "
               "block), layer types ['mamba', 'moe'] (see distributed/activation_checkpoint)",
        range=AT_LEAST_1, unit="blocks")
    compile: bool | str = key("auto", "torch.compile each block (distributed/compile.py); auto "
                                      "-> on CUDA, off on CPU", choices=("auto",))
    deterministic: bool = key(False, "torch.use_deterministic_algorithms + deterministic "
                                     "kernels")
    gc_every_steps: int | None = key(None, "run gc.collect() every N steps (null or 0: Python "
                                           "default)", range=AT_LEAST_0, unit="steps")
    max_time: str | int | float | None = key(
        None, "wall-clock limit of the run, e.g. '3h50m', '45m', '90s' (units d, h, m, s): the "
              "run saves a checkpoint and exits 75 early enough for the save to finish before "
              "it; null -> no limit", range=ABOVE_0)

    def problem(self) -> tuple[str, str] | None:
        return None if self.max_time is None else _unreadable(self, "max_time", parse_duration)


@dataclass
class OptimizerSection(RecipeSection):
    """``optimizer:``: AdamW settings (or a ``_target_`` mapping)."""

    section: ClassVar[str] = "optimizer"
    name: str = key("adamw", "optimizer (AdamW; norms and biases get no weight decay)",
                    choices=("adamw",))
    lr: float = key(1e-4, "peak learning rate", range=AT_LEAST_0)
    weight_decay: float = key(0.0, "decoupled weight decay (not applied to norms/biases)",
                              range=AT_LEAST_0)
    betas: list[float] | tuple[float, ...] = key([0.9, 0.999], "Adam betas (two)",
                                                 range="[0, 1)")
    eps: float = key(1e-8, "Adam epsilon", range=AT_LEAST_0)
    implementation: str = key("auto", "auto -> fused when torch has it for the device (CUDA and "
                                      "CPU), else foreach",
                              choices=("auto", "fused", "foreach", "for_loop"))

    def problem(self) -> tuple[str, str] | None:
        if len(self.betas) != 2:
            return "betas", (f"optimizer.betas must be two numbers in [0, 1), e.g. [0.9, 0.999]; "
                             f"got {list(self.betas)!r}")
        return None


@dataclass
class LRSchedulerSection(RecipeSection):
    """``lr_scheduler:``: warmup + constant/linear/cosine/WSD decay."""

    section: ClassVar[str] = "lr_scheduler"
    lr_decay_style: str = key("constant", "shape after warmup",
                              choices=("constant", "linear", "cosine", "wsd"))
    lr_warmup_steps: int = key(0, "linear warmup length", range=AT_LEAST_0, unit="steps")
    lr_warmup_samples: int | None = key(None, "warmup length in samples (instead of "
                                              "lr_warmup_steps)", range=AT_LEAST_0,
                                        unit="samples")
    lr_decay_steps: int | None = key(None, "steps from start to end of decay; null -> "
                                           "max_steps", range=AT_LEAST_1, unit="steps")
    lr_decay_samples: int | None = key(None, "decay length in samples (instead of "
                                             "lr_decay_steps)", range=AT_LEAST_1, unit="samples")
    lr_wsd_decay_style: str = key("linear", "WSD: shape of the final decay phase",
                                  choices=("linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_steps: int | None = key(None, "WSD: length of the final decay phase; null -> "
                                               "10% of the decay length",
                                         range=AT_LEAST_1, unit="steps")
    lr_wsd_decay_samples: int | None = key(None, "WSD: decay phase length in samples",
                                           range=AT_LEAST_1, unit="samples")
    init_lr: float = key(0.0, "learning rate at the start of warmup", range=AT_LEAST_0)
    min_lr: float = key(0.0, "learning rate at the end of decay", range=AT_LEAST_0)

    def problem(self) -> tuple[str, str] | None:
        """Lengths that cannot describe a schedule: steps mixed with samples, a warmup longer
        than the decay it precedes, a WSD decay phase that does not fit after the warmup. (A
        warmup longer than a run with no decay length given warms up over the whole run, as a
        shortened trial run of a long recipe does: consistency.py says so.)"""
        samples = [k for k in ("lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples")
                   if getattr(self, k) is not None]
        steps = [k for k in ("lr_decay_steps", "lr_wsd_decay_steps")
                 if getattr(self, k) is not None] + ["lr_warmup_steps"] * bool(self.lr_warmup_steps)
        if samples and steps:
            return steps[0], (f"lr_scheduler: {', '.join(steps)} mixed with {', '.join(samples)}; "
                              "give all lengths in steps or all in samples")
        unit = "samples" if samples else "steps"
        warmup = getattr(self, f"lr_warmup_{unit}") or 0
        decay, wsd = getattr(self, f"lr_decay_{unit}"), getattr(self, f"lr_wsd_decay_{unit}")
        if self.lr_decay_style == "constant" or decay is None:
            return None
        if warmup > decay:
            return f"lr_warmup_{unit}", (
                f"lr_scheduler.lr_warmup_{unit}={warmup} is longer than lr_decay_{unit}={decay}: "
                f"the '{self.lr_decay_style}' decay would end before the warmup does; shorten "
                f"the warmup or lengthen lr_decay_{unit}")
        if self.lr_decay_style == "wsd" and wsd is not None and wsd > decay - warmup:
            return f"lr_wsd_decay_{unit}", (
                f"lr_scheduler.lr_wsd_decay_{unit}={wsd} does not fit after a warmup of {warmup} "
                f"within lr_decay_{unit}={decay}")
        return None


@dataclass
class CheckpointSection(RecipeSection):
    """``checkpoint:``: output folder, checkpoints, resume, HF export."""

    section: ClassVar[str] = "checkpoint"
    dir: str = key("outputs/run", "the run's output folder: training.jsonl, validation.jsonl, "
                                  "step_{N}/, latest, loss.png", path="folder")
    enabled: bool = key(True, "write step_{N}/ checkpoints (every ckpt_every_steps and at the "
                              "end)")
    resume: str | bool | None = key(None, "null: start fresh; auto: resume from <dir>/latest if "
                                          "present; or a path to a step_{N} folder",
                                    path="folder")
    overwrite: bool = key(False, "with resume null, start over in a checkpoint.dir that holds "
                                 "an earlier run's step_{N}/ (deleting them); false -> refuse "
                                 "with an error")
    keep_last: int | None = key(None, "keep only the newest K step_{N}/ folders (null: keep "
                                      "all)", range=AT_LEAST_1, unit="checkpoints")
    save_hf_at_end: bool = key(True, "write a consolidated HF export (hf/ or adapter/) at the "
                                     "end")
    save_hf_every: bool = key(False, "also write the HF export inside every step_{N}/")
    save_dtype: str = key("auto", "dtype of the HF export (hf/, convert); step_{N}/ always keeps "
                                  "the float32 masters. auto -> the dtype the weights were "
                                  "loaded from (bfloat16 for a bf16 Hub checkpoint), else the "
                                  "parameter dtype", choices=("auto", *DTYPE_NAMES))
    save_merged_hf: bool = key(False, "LoRA: also write a merged full-weight HF dir "
                                      "(merged_hf/)")
    save_on_signal: list[str] = key(["SIGTERM", "SIGUSR1"],
                                    "signals that stop the run at the next step boundary with a "
                                    "checkpoint and exit 75 (resume with checkpoint.resume: "
                                    "auto); [] -> the signals' default action")

    def problem(self) -> tuple[str, str] | None:
        return _unreadable(self, "save_on_signal", parse_signals)


@dataclass
class PeftSection(RecipeSection):
    """``peft:``: LoRA (absent -> full fine-tuning)."""

    section: ClassVar[str] = "peft"
    method: str = key("lora", "PEFT method", choices=("lora",))
    dim: int = key(8, "LoRA rank", range=AT_LEAST_1)
    alpha: int | float = key(32, "LoRA alpha (scale = alpha / dim)", range=ABOVE_0)
    dropout: float = key(0.0, "dropout on the LoRA input", range="[0, 1)")
    target_modules: list[str] = key([], "glob patterns of module names to adapt (e.g. "
                                        "'*.q_proj')")
    exclude_modules: list[str] = key([], "glob patterns of module names never adapted")
    match_all_linear: bool = key(False, "adapt every linear layer (except lm_head/embeddings)")
    base_quant: str | None = key(None, "the frozen base weights under the adapters: null (as "
                                       "loaded) or nf4 (QLoRA: 4-bit NormalFloat with "
                                       "double-quantised scales; needs torchao, the quant extra)",
                                 choices=("nf4",))

    def problem(self) -> tuple[str, str] | None:
        if not self.match_all_linear and not self.target_modules:
            return "match_all_linear", (
                "peft.match_all_linear is false and peft.target_modules is empty: nothing says "
                "which layers to adapt. Set peft.match_all_linear: true (every linear layer but "
                "lm_head, and the MoE experts) or list peft.target_modules (globs, e.g. "
                "['*.q_proj'])")
        return None


@dataclass
class DistributedSection(RecipeSection):
    """``distributed:``: parallel layout and process-group options."""

    section: ClassVar[str] = "distributed"
    backend: str = key("auto", "auto -> nccl on GPU, gloo on CPU",
                       choices=("auto", "nccl", "gloo"))
    dp_replicate: int = key(1, "data-parallel replicas (HSDP outer dim)", range=AT_LEAST_1,
                            unit="ranks")
    dp_shard: int = key(-1, "FSDP shard degree; -1 -> whatever the other degrees leave",
                        range="[-1, inf)", unit="ranks")
    cp: int = key(1, "context-parallel degree", range=AT_LEAST_1, unit="ranks")
    tp: int = key(1, "tensor-parallel degree", range=AT_LEAST_1, unit="ranks")
    pp: int = key(1, "pipeline-parallel degree", range=AT_LEAST_1, unit="ranks")
    ep: int = key(1, "expert-parallel degree (borrowed from dp_shard*cp)", range=AT_LEAST_1,
                  unit="ranks")
    encoder_ranks: int = key(0, "heterogeneous layout: the model's encoder (vision + projector) "
                                "on ranks 0..E-1, the rest on the others; 0 -> every module on "
                                "every rank", range=AT_LEAST_0, unit="ranks")
    ep_backend: str = key("alltoall", "expert token dispatch: torch all-to-all, or DeepEP (CUDA)",
                          choices=("alltoall", "deepep"))
    pp_schedule: str = key("1f1b", "pipeline schedule: 1f1b, gpipe, interleaved1f1b, loopedbfs, "
                                   "interleavedzb, zbv, dualpipev (case and '_' insensitive)")
    pp_stages_per_rank: int | None = key(None, "stages per rank for interleaved / V schedules; "
                                               "null -> 2 for those, else 1",
                                         range=AT_LEAST_1, unit="stages")
    pp_microbatch_size: int | None = key(None, "rows per pipeline micro-batch; null -> the "
                                               "trainer's micro-batches (same micro-batching as "
                                               "one process)", range=AT_LEAST_1, unit="samples")
    pp_split_points: list[int] | None = key(None, "manual split: first layer index of every "
                                                  "stage after the first; null -> balanced by "
                                                  "per-layer FLOPs", range=AT_LEAST_1)
    sequence_parallel: bool = key(False, "with tp > 1: the residual stream and the norms hold "
                                         "each tp rank's 1/tp of every row; the mixers gather "
                                         "whole rows (their saved inputs keep 1/tp, gathered "
                                         "again in backward). No effect with tp: 1")
    fsdp_reshard_after_forward: str = key("default", "FSDP2 reshard policy (default: reshard, "
                                                     "except under pp; always: under pp each "
                                                     "unit also reshards after its backward, "
                                                     "less memory)",
                                          choices=("default", "always", "never"))
    fsdp_backward_prefetch: bool = key(True, "FSDP2 all-gathers the next unit of backward while "
                                             "one computes; false: one unit at a time (less "
                                             "memory, no overlap)")
    fsdp_param_dtype: str = key("auto", "FSDP2 all-gather/compute dtype; auto -> training dtype",
                                choices=("auto", "float32", "bfloat16"))
    fsdp_reduce_dtype: str = key("float32", "gradient reduce-scatter dtype",
                                 choices=("float32", "bfloat16"))
    cpu_offload: bool = key(False, "FSDP2 CPU offload of parameters/optimizer state")
    timeout_seconds: int = key(1800, "process-group timeout", range=AT_LEAST_1, unit="s")


@dataclass
class MetricsSection(RecipeSection):
    """``metrics:``: jsonl / progress bar / TensorBoard / plot / W&B / MLflow."""

    section: ClassVar[str] = "metrics"
    jsonl: bool = key(True, "write <checkpoint.dir>/training.jsonl and validation.jsonl")
    progress_bar: bool = key(True, "rank-0 tqdm bar (loss, lr, tokens/s, ETA)")
    tensorboard: bool = key(False, "write TensorBoard events (needs the tb extra)")
    tensorboard_dir: str | None = key(None, "null -> <checkpoint.dir>/tb", path="folder")
    plot: bool = key(True, "write <checkpoint.dir>/loss.png at the end (needs the plot extra)")
    peak_tflops: float | None = key(None, "per-device peak for MFU; null -> detect from device "
                                          "name", range=ABOVE_0, unit="TFLOP/s")
    wandb: bool = key(False, "log to Weights & Biases from rank 0 (needs the wandb extra; offline "
                             "through WANDB_MODE=offline; files under WANDB_DIR, else "
                             "<checkpoint.dir>)")
    mlflow: bool = key(False, "log to MLflow from rank 0 (needs the mlflow extra): the recipe as "
                              "params, metrics per step, the HF export or adapter as an artifact")
    project: str | None = key(None, "W&B project and MLflow experiment; null -> WANDB_PROJECT / "
                                    "MLFLOW_EXPERIMENT_NAME, else 'hybridtrain'")
    run_name: str | None = key(None, "the trackers' run name; null -> WANDB_NAME / the "
                                     "tracker's own")
    tags: list[str] = key([], "tags of the tracker runs (W&B tags; MLflow tags with an empty "
                              "value)")
    mlflow_tracking_uri: str | None = key(None, "MLflow store or server; null -> "
                                                "MLFLOW_TRACKING_URI, else "
                                                "sqlite:///<checkpoint.dir>/mlflow.db")
    tracker_on_error: str = key("warn", "a tracker that cannot start: warn (the run goes on "
                                        "without it) or raise (the run stops before its first "
                                        "step)", choices=("warn", "raise"))


@dataclass
class EvaluationSection(RecipeSection):
    """``evaluation:``: answers generated for validation examples at each validation."""

    section: ClassVar[str] = "evaluation"
    num_examples: int = key(32, "validation examples answered by generation at each validation "
                                "(the first N of validation_dataset)",
                            range=AT_LEAST_1, unit="examples")
    max_new_tokens: int = key(32, "tokens generated per answer at most (a reply also stops at "
                                  "eos or the reference's end-of-turn token)",
                              range=AT_LEAST_1, unit="tokens")
    batch_size: int = key(8, "prompts generated together (left-padded)", range=AT_LEAST_1,
                          unit="prompts")
    do_sample: bool = key(False, "sample instead of greedy decoding (the metrics use what is "
                                 "generated)")
    temperature: float = key(1.0, "sampling temperature (do_sample)", range=AT_LEAST_0)
    top_k: int = key(0, "sampling: keep the k most likely tokens (0: all)", range=AT_LEAST_0,
                     unit="tokens")
    top_p: float = key(1.0, "sampling: nucleus probability (1.0: all)", range="(0, 1]")
    seed: int = key(0, "sampling seed (the same replies at every validation for the same "
                       "weights)", range=SEED)
    num_samples: int = key(4, "replies written to samples_file at each validation (prompt, "
                              "reply, reference); 0: none", range=AT_LEAST_0, unit="replies")
    samples_file: str = key("samples.jsonl", "file in checkpoint.dir the sample replies are "
                                             "appended to", path="file")

    def problem(self) -> tuple[str, str] | None:
        if self.do_sample and self.temperature == 0:
            return "temperature", ("evaluation.temperature 0 with do_sample: true; temperature "
                                   "0 is greedy decoding: set do_sample: false (or a temperature "
                                   "> 0)")
        return None


@dataclass
class BenchmarkSection(RecipeSection):
    """``benchmark:``: options of ``hybridtrain benchmark``; finetune ignores them."""

    section: ClassVar[str] = "benchmark"
    data: str = key("synthetic", "synthetic: random tokens in rows of seq_len; recipe: the "
                                 "recipe's dataset (tokenizer, packing and batch sizes)",
                    choices=("synthetic", "recipe"))
    seq_len: int | None = key(None, "synthetic row length; null -> packing.pack_size when "
                                    "packing is on, else the dataset's seq_length, else 2048",
                              range=AT_LEAST_1, unit="tokens")
    doc_length: int | None = key(None, "synthetic: split each row into documents of this many "
                                       "tokens (the packed-sequence path, cu_seqlens); null -> "
                                       "one document per row", range=AT_LEAST_1, unit="tokens")
    tokens_per_step: int | None = key(None, "synthetic: rows per step = tokens_per_step / "
                                            "seq_len (per rank, one micro-batch); null -> "
                                            "global_batch_size / dp * seq_len",
                                      range=AT_LEAST_1, unit="tokens")
    warmup_steps: int = key(2, "steps run before timing", range=AT_LEAST_0, unit="steps")
    steps: int = key(5, "timed steps", range=AT_LEAST_1, unit="steps")
    seq_lengths: list[int] | None = key([512, 2048, 8192], "cost growth: the synthetic "
                                                           "measurement repeated at each length "
                                                           "with the same tokens per step ([] "
                                                           "to skip)",
                                        range=AT_LEAST_1, unit="tokens")
    dtypes: list[str] | None = key(None, "compute dtypes to compare, e.g. [float32, bfloat16] "
                                         "(single process only); null -> training.dtype")
    profile: bool | str = key(False, "true or a folder: torch profiler trace (Chrome/Perfetto "
                                     "JSON) of profile_steps steps after the timed ones",
                              path="folder")
    profile_steps: int = key(2, "steps traced when profile is on", range=AT_LEAST_1,
                             unit="steps")
    measure_peak: bool = key(False, "also measure the device's matmul peak (an n x n matmul) "
                                    "and report MFU against it")
    output: str | None = key(None, "results JSON file; null -> <checkpoint.dir>/benchmark.json",
                             path="file")
    decode_tokens: int = key(0, "decoding table: greedy tokens/s of this many new tokens from a "
                                "64-token synthetic prompt (batch 1, one process), plain and with "
                                "the model's self-speculative decoding side by side; 0 -> no "
                                "table", range=AT_LEAST_0, unit="tokens")
    draft_tokens: int = key(3, "decoding table: tokens drafted per speculative step",
                            range=AT_LEAST_1, unit="tokens")


@dataclass
class RLSection(RecipeSection):
    """``rl:``: the RL Policy's batch layout (``hybridtrain.rl.Policy``)."""

    section: ClassVar[str] = "rl"
    sequence_packing: bool = key(False, "Policy: pack each micro-batch's rows into one row of "
                                        "documents (no padding computed; targets never cross a "
                                        "document)")
    micro_batch_size: int | None = key(None, "Policy: rows per forward/backward on one rank; "
                                             "null -> training.micro_batch_size",
                                       range=AT_LEAST_1, unit="samples")
    pad_to_multiple_of: int = key(1, "Policy: pad each packed row to a multiple of this",
                                  range=AT_LEAST_1, unit="tokens")


@dataclass
class DPOSection(RecipeSection):
    """``dpo:``: options of ``hybridtrain dpo``."""

    section: ClassVar[str] = "dpo"
    reference_policy_kl_penalty: float = key(0.05, "DPO beta", range=ABOVE_0)
    preference_loss_weight: float = key(1.0, "weight of the preference term", range=AT_LEAST_0)
    sft_loss_weight: float = key(0.0, "weight of the NLL of the chosen responses",
                                 range=AT_LEAST_0)
    preference_average_log_probs: bool = key(False, "average (not sum) the log-probs of a "
                                                    "response")


@dataclass
class GRPOSection(RecipeSection):
    """``grpo:``: options of ``hybridtrain grpo``."""

    section: ClassVar[str] = "grpo"
    num_prompts_per_step: int = key(8, "prompts per step", range=AT_LEAST_1, unit="prompts")
    num_generations_per_prompt: int = key(8, "samples per prompt (the group of the advantages; "
                                             "2 or more)", range=AT_LEAST_1, unit="samples")
    max_new_tokens: int = key(8, "generated tokens per sample", range=AT_LEAST_1, unit="tokens")
    temperature: float = key(1.0, "sampling temperature of the rollouts (> 0)", range=AT_LEAST_0)
    ratio_clip_min: float = key(0.2, "PPO epsilon below 1", range="[0, 1)")
    ratio_clip_max: float = key(0.2, "PPO epsilon above 1", range=AT_LEAST_0)
    ratio_clip_c: float | None = key(None, "dual-clip constant (> 1); null: off",
                                     range="(1, inf)")
    reference_policy_kl_penalty: float = key(0.01, "KL coefficient beta to the frozen reference",
                                             range=AT_LEAST_0)
    kl_type: str = key("k3", "KL estimator", choices=("k1", "k2", "k3"))
    token_level_loss: bool = key(True, "normalise by tokens (false: by sequences)")
    normalize_rewards: bool = key(True, "divide the group-centred rewards by the group's std")
    updates_per_rollout: int = key(2, "optimizer steps per batch of rollouts (its prompt groups "
                                      "split evenly; after the first the policy is off the "
                                      "sampling one: ratio and clipping at work)",
                                   range=AT_LEAST_1, unit="steps")
    speculative: str | None = key(None, "rollouts by the model's self-speculative sampling "
                                        "(drafted by its MTP layers, the same distribution, one "
                                        "prompt at a time): null | mtp", choices=("mtp",))
    draft_tokens: int = key(3, "tokens drafted per speculative round (with speculative)",
                            range=AT_LEAST_1, unit="tokens")
    task: dict = key({}, "the verifiable task: a _target_ mapping building a task object "
                         "(prompts(n, rng), reward(prompt, completion)); {} -> "
                         "hybridtrain.rl.tasks.CountingTask")

    def problem(self) -> tuple[str, str] | None:
        """Settings under which no update can learn anything."""
        P, G, U = self.num_prompts_per_step, self.num_generations_per_prompt, \
            self.updates_per_rollout
        if P % U:
            return "updates_per_rollout", (
                f"grpo.num_prompts_per_step={P} must be a multiple of grpo.updates_per_rollout="
                f"{U} (each update takes whole groups)")
        if G < 2:
            return "num_generations_per_prompt", (
                f"grpo.num_generations_per_prompt={G}: an advantage is a reward minus its group's "
                "mean, so a group of one has every advantage 0 and nothing is learned; use 2 or "
                "more")
        if self.temperature == 0:
            return "temperature", (
                f"grpo.temperature={self.temperature} must be > 0: rollouts are sampled, and a "
                "group of identical completions has every advantage 0")
        return None


@dataclass
class RecipeConfig:
    """A recipe, typed: each fixed section as its ``*Section`` object (its defaults when the
    recipe leaves it out), the open sections as ``ConfigNode`` (their keys are the target's
    arguments). ``node`` is the loaded tree (``to_yaml``, the ``_target_`` allow-list, every
    key's source line); :func:`~hybridtrain.config.sections.recipe_config` makes one."""

    model: ConfigNode | None = open_section("the model: a _target_ mapping")
    tokenizer: ConfigNode | None = open_section("the tokenizer: a _target_ mapping")
    dataset: ConfigNode | None = open_section("the training dataset: a _target_ mapping")
    validation_dataset: ConfigNode | None = open_section("the validation dataset (optional)")
    dataloader: DataloaderSection = section(DataloaderSection, "data-loader options")
    packing: PackingSection = section(PackingSection, "sequence packing")
    training: TrainingSection = section(TrainingSection, "batch sizes, lengths, intervals, "
                                                         "seed, dtype, clipping")
    optimizer: OptimizerSection | ConfigNode = section(
        OptimizerSection, "AdamW settings (or a _target_ mapping)", target_ok=True)
    lr_scheduler: LRSchedulerSection | ConfigNode = section(
        LRSchedulerSection, "warmup + constant/linear/cosine/WSD decay", target_ok=True)
    checkpoint: CheckpointSection = section(CheckpointSection, "output folder, checkpoints, "
                                                               "resume, HF export")
    peft: PeftSection | None = section(PeftSection, "LoRA (absent -> full fine-tuning)",
                                       optional=True)
    distributed: DistributedSection = section(DistributedSection, "parallel layout and "
                                                                  "process-group options")
    metrics: MetricsSection = section(MetricsSection, "jsonl / progress bar / TensorBoard / plot")
    dist_env: ConfigNode | dict = env_section(
        "environment variables set before CUDA/process-group init (key upper-cased; true/false "
        "-> 1/0; a variable already set wins)")
    evaluation: EvaluationSection | None = section(
        EvaluationSection, "answers generated for validation examples at each validation: SQuAD "
                           "exact match / F1 and sample replies in validation.jsonl (absent -> "
                           "off)", optional=True)
    benchmark: BenchmarkSection | None = section(
        BenchmarkSection, "options of `hybridtrain benchmark`; finetune ignores them",
        optional=True)
    rl: RLSection = section(RLSection, "the RL Policy's batch layout (hybridtrain.rl.Policy)")
    dpo: DPOSection = section(DPOSection, "options of `hybridtrain dpo`")
    grpo: GRPOSection = section(GRPOSection, "options of `hybridtrain grpo`")
    allowed_target_prefixes: list[str] = key([], "extra module prefixes allowed in _target_ "
                                                 "(besides hybridtrain., torch.nn., torch.optim.)")
    node: ConfigNode | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def source_file(self) -> str:
        return self.node.source_file if self.node is not None else "<recipe built in code>"

    def to_yaml(self) -> str:
        """The resolved recipe as YAML (saved next to the checkpoints)."""
        assert self.node is not None, "to_yaml needs a loaded recipe (recipe_config)"
        return self.node.to_yaml()


# the sections and top-level keys, read from the classes (the loader, the docs and --help use
# these); every fixed section's class by name
SECTIONS = sections_of(RecipeConfig)
TOP_LEVEL_KEYS = keys_of(RecipeConfig)
SECTION_TYPES: dict[str, type[RecipeSection]] = {
    name: sec.cls for name, sec in SECTIONS.items() if sec.cls is not None}
