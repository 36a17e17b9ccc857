"""``hybridtrain import-recipe AUTOMODEL.yaml [-o OUT.yaml] [--model-dir DIR]``: a NeMo Automodel
fine-tuning recipe as a hybridtrain recipe.

Each Automodel key goes to its hybridtrain key; a comment above a key says where its meaning
changed (a Hub id that must be a local folder here, a default Automodel applies implicitly, a unit
that differs). Keys with no equivalent are listed at the end of the file and on stderr with what
to do. The model class comes from the model folder's ``config.json`` (``model_type`` -> the
registered model spec): ``--model-dir``, else ``pretrained_model_name_or_path`` when it is a
folder, else its snapshot in the Hugging Face cache.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

__all__ = ["Converted", "convert", "render", "run"]

_REFERENCE = "the recipe reference (python -m hybridtrain.config.reference)"
_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow", ".csv")
_ENV_PREFIXES = ("torch_", "pytorch_", "nccl_", "cuda_", "omp_", "mkl_", "nvte_", "tokenizers_")

# Automodel key -> hybridtrain key, same meaning
RENAMES = {
    "step_scheduler.global_batch_size": "training.global_batch_size",
    "step_scheduler.local_batch_size": "training.micro_batch_size",
    "step_scheduler.max_steps": "training.max_steps",
    "step_scheduler.num_epochs": "training.num_epochs",
    "step_scheduler.val_every_steps": "training.val_every_steps",
    "step_scheduler.ckpt_every_steps": "training.ckpt_every_steps",
    "rng.seed": "training.seed",
    "distributed.dp_replicate_size": "distributed.dp_replicate",
    "distributed.tp_size": "distributed.tp",
    "distributed.cp_size": "distributed.cp",
    "distributed.pp_size": "distributed.pp",
    "distributed.ep_size": "distributed.ep",
    "distributed.sequence_parallel": "distributed.sequence_parallel",
    "distributed.activation_checkpointing": "training.activation_checkpointing",
    "autopipeline.pp_schedule": "distributed.pp_schedule",
    "autopipeline.pp_microbatch_size": "distributed.pp_microbatch_size",
    "peft.dim": "peft.dim",
    "peft.alpha": "peft.alpha",
    "peft.dropout": "peft.dropout",
    "peft.match_all_linear": "peft.match_all_linear",
    "peft.target_modules": "peft.target_modules",
    "peft.exclude_modules": "peft.exclude_modules",
    "lr_scheduler.lr_decay_style": "lr_scheduler.lr_decay_style",
    "lr_scheduler.lr_warmup_steps": "lr_scheduler.lr_warmup_steps",
    "lr_scheduler.lr_decay_steps": "lr_scheduler.lr_decay_steps",
    "lr_scheduler.min_lr": "lr_scheduler.min_lr",
    "lr_scheduler.init_lr": "lr_scheduler.init_lr",
    "lr_scheduler.lr_wsd_decay_style": "lr_scheduler.lr_wsd_decay_style",
    "lr_scheduler.lr_wsd_decay_steps": "lr_scheduler.lr_wsd_decay_steps",
    "dataloader.shuffle": "dataloader.shuffle",
    "dataloader.num_workers": "dataloader.num_workers",
    "checkpoint.enabled": "checkpoint.enabled",
    "checkpoint.checkpoint_dir": "checkpoint.dir",
    "checkpoint.restore_from": "checkpoint.resume",
    "compile.enabled": "training.compile",
    "packed_sequence.split_across_pack": "packing.split_across_pack",
    "clip_grad_norm.max_norm": "training.grad_clip",
    "wandb.project": "metrics.project",
    "wandb.name": "metrics.run_name",
    "wandb.tags": "metrics.tags",
    "mlflow.experiment_name": "metrics.project",
    "mlflow.run_name": "metrics.run_name",
    "mlflow.tracking_uri": "metrics.mlflow_tracking_uri",
}

# Automodel keys with no equivalent that need nothing done: what hybridtrain does instead
NOTHING_TO_DO = {
    "recipe": "hybridtrain finetune is the recipe",
    "ci": "Automodel's CI settings",
    "loss_fn": "hybridtrain's loss is the token-weighted masked cross-entropy (fused with the "
               "LM head: training.fused_loss)",
    "rng._target_": "training.seed seeds model init, data order and dropout",
    "rng.ranked": "training.seed seeds model init, data order and dropout",
    "distributed._target_": "hybridtrain always uses FSDP2 (plus tp/pp/cp/ep)",
    "distributed.strategy": "hybridtrain always uses FSDP2 (plus tp/pp/cp/ep)",
    "dataloader._target_": "hybridtrain builds its own data loader",
    "dataloader.collate_fn": "hybridtrain pads or packs the batch itself",
    "validation_dataloader": "validation uses training.val_micro_batch_size and max_val_steps",
    "peft.use_triton": "a kernel choice of Automodel's LoRA",
    "peft.use_memory_efficient_lora": "a kernel choice of Automodel's LoRA",
    "compile.mode": "hybridtrain compiles each block whole (training.compile)",
    "compile.fullgraph": "hybridtrain compiles each block whole (training.compile)",
    "compile.dynamic": "hybridtrain compiles each block whole (training.compile)",
    "compile.backend": "hybridtrain compiles each block whole (training.compile)",
    "autopipeline._target_": "distributed.pp* keys set the pipeline",
    "autopipeline.round_virtual_stages_to_pp_multiple": "distributed.pp_stages_per_rank is set",
    "autopipeline.scale_grads_in_schedule": "hybridtrain scales gradients by label tokens",
    "autopipeline.patch_inner_model": "hybridtrain's model code is pipeline-ready",
    "autopipeline.patch_causal_lm_model": "hybridtrain's model code is pipeline-ready",
    "model._target_": "the model class comes from the model folder's config.json",
    "model.trust_remote_code": "hybridtrain runs its own model code, never the Hub's",
    "model.attn_implementation": "hybridtrain picks the attention kernel (flash-attn varlen or "
                                 "SDPA)",
    "model.backend._target_": "kernel choices: training.grouped_mm, distributed.ep_backend",
    "model.backend.rms_norm": "hybridtrain's norm keeps float32 statistics",
    "model.backend.linear": "hybridtrain uses torch linear layers",
    "model.backend.attn": "hybridtrain picks the attention kernel",
    "checkpoint.model_save_format": "step_N/ is a torch.distributed.checkpoint; exports are "
                                    "safetensors",
    "checkpoint.load_base_model": "model.local_dir is loaded",
    "checkpoint.dequantize_base_checkpoint": "hybridtrain loads bf16/fp32 checkpoints",
    "peft._target_": "peft.method: lora",
}


@dataclass
class Converted:
    """A hybridtrain recipe (nested, in writing order), the comments at keys whose meaning
    changed, and the Automodel keys left out with what to do."""

    tree: dict = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    left_out: list[tuple[str, str]] = field(default_factory=list)

    def set(self, dotted: str, value: Any, note: str | None = None) -> None:
        *parents, leaf = dotted.split(".")
        node = self.tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        if note:
            self.notes[dotted] = note

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.tree
        for p in dotted.split("."):
            if not isinstance(node, dict) or p not in node:
                return default
            node = node[p]
        return node

    def leave_out(self, key: str, advice: str) -> None:
        self.left_out.append((key, advice))


def _flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: leaf}`` (lists and empty mappings stay leaves)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _is_local(path: str) -> bool:
    """Whether a dataset source names a local file or folder (else a Hub id, ``org/name``)."""
    return (os.path.exists(os.path.expanduser(path)) or path.startswith(("/", "./", "../", "~"))
            or path.endswith(_DATA_SUFFIXES))


# -- the model ----------------------------------------------------------------------------------
def _hf_cache_snapshot(repo_id: str) -> str | None:
    """The newest snapshot folder of ``repo_id`` in the Hugging Face cache, if any."""
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    pattern = os.path.join(cache, "models--" + repo_id.replace("/", "--"), "snapshots", "*",
                           "config.json")
    found = sorted(glob.glob(pattern), key=os.path.getmtime)
    return os.path.dirname(found[-1]) if found else None


def _model_dir(name: str | None, override: str | None) -> tuple[str, str | None]:
    """(the local model folder, a note when it is not what the recipe named)."""
    if override:
        return override, (f"Automodel's pretrained_model_name_or_path {name!r}; a local folder "
                          "here (--model-dir)") if name and name != override else None
    if name and os.path.isfile(os.path.join(os.path.expanduser(name), "config.json")):
        return name, None
    snapshot = _hf_cache_snapshot(name) if name else None
    if snapshot:
        return snapshot, (f"{name} from the Hugging Face cache: hybridtrain reads a local folder "
                          "and never downloads")
    raise ValueError(
        f"model.pretrained_model_name_or_path {name!r}: no config.json found (not a local folder, "
        f"not in the Hugging Face cache); download it (`hf download {name} --local-dir DIR`) and "
        "pass --model-dir DIR")


def _model_target(model_dir: str) -> str:
    """``module.Class.from_pretrained`` of the registered model family of ``model_dir``."""
    from hybridtrain.models.spec import get_model_spec

    path = os.path.join(os.path.expanduser(model_dir), "config.json")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    cls = get_model_spec(str(model_type)).model_cls
    return f"{cls.__module__}.{cls.__qualname__}.from_pretrained"


def _model(sec: Mapping, out: Converted, model_dir: str | None, lora: bool) -> None:
    directory, note = _model_dir(sec.get("pretrained_model_name_or_path"), model_dir)
    out.set("tokenizer._target_", "hybridtrain.data.load_tokenizer")
    out.set("tokenizer.path", directory)
    out.set("model._target_", _model_target(directory))
    out.set("model.local_dir", directory, note)
    dtype = sec.get("torch_dtype")
    if not lora:
        out.set("model.dtype", "float32", "fp32 master weights (Automodel trains in torch_dtype"
                f"{' ' + str(dtype) if dtype else ''}); compute in bf16 on GPU "
                "(training.dtype auto)")
    elif dtype not in (None, "auto"):
        out.set("model.dtype", str(dtype).replace("torch.", ""))
    backend = sec.get("backend") or {}
    if backend.get("experts") == "gmm":
        out.set("training.grouped_mm", True)
    if backend.get("dispatcher") == "deepep":
        out.set("distributed.ep_backend", "deepep")
    if sec.get("use_liger_kernel"):
        out.set("training.fused_loss", "auto", "use_liger_kernel: Liger's fused linear "
                "cross-entropy where it imports on CUDA (liger: always)")
    handled = {"pretrained_model_name_or_path", "torch_dtype", "use_liger_kernel",
               "backend.experts", "backend.dispatcher"}
    for key, value in _flat(sec).items():
        if key not in handled:
            _unmapped(f"model.{key}", out)


# -- data ---------------------------------------------------------------------------------------
def _dataset(name: str, sec: Mapping, out: Converted) -> None:
    target = str(sec.get("_target_", ""))
    kind = "squad" if "squad" in target.lower() else "chat" if "chat" in target.lower() else None
    if kind is None:
        out.leave_out(f"{name}._target_: {target}", "no hybridtrain builder for it: write the "
                      "data as chat JSONL (messages) or SQuAD JSON and use "
                      "hybridtrain.data.build_chat_dataset / build_squad_dataset")
        return
    source = next((sec[k] for k in ("path_or_dataset_id", "path_or_dataset", "dataset_name")
                   if k in sec), None)
    out.set(f"{name}._target_", f"hybridtrain.data.build_{kind}_dataset")
    val = name == "validation_dataset"
    if source is not None and _is_local(str(source)):
        out.set(f"{name}.path", source)
    elif kind == "squad":
        out.set(f"{name}.path", f"data/squad/{'dev' if val else 'train'}-v1.1.json",
                f"Automodel's {source} ({sec.get('split', 'train')}): hybridtrain reads a local "
                "SQuAD v1.1 JSON (train-v1.1.json / dev-v1.1.json), never the Hub")
    else:
        out.set(f"{name}.path", f"data/{'validation' if val else 'train'}.jsonl",
                f"Automodel's {source}: hybridtrain reads a local JSONL, Parquet or Arrow file "
                "of conversations, never the Hub")
    path = str(out.get(f"{name}.path"))
    for key, value in sec.items():
        if key in ("_target_", "path_or_dataset_id", "path_or_dataset", "dataset_name"):
            continue
        if key == "split":
            if _is_local(path) and not path.endswith(_DATA_SUFFIXES):
                out.set(f"{name}.split", value)  # a folder of several splits
        elif key == "limit_dataset_samples":
            out.set(f"{name}.limit", value)
        elif key in ("seq_length", "padding") or key in (
                ("truncation",) if kind == "squad" else ("chat_template", "chat_template_kwargs")):
            out.set(f"{name}.{key}", value)
        else:
            _unmapped(f"{name}.{key}", out)


def _packing(sec: Mapping, out: Converted) -> None:
    size = sec.get("packed_sequence_size") or 0
    out.set("packing.enabled", bool(size))
    if size:
        out.set("packing.pack_size", size)
    for key in sec:
        if key not in ("packed_sequence_size",):
            _rename(f"packed_sequence.{key}", sec[key], out)


# -- optimizer and schedule ---------------------------------------------------------------------
def _optimizer(sec: Mapping, out: Converted) -> None:
    target = str(sec.get("_target_", "torch.optim.AdamW"))
    keys = {k: v for k, v in sec.items() if k != "_target_"}
    if target.rsplit(".", 1)[-1] not in ("Adam", "AdamW"):
        out.set("optimizer._target_", target, "kept as is: hybridtrain's own optimizer is AdamW "
                "(norms and biases without weight decay)")
        for k, v in keys.items():
            out.set(f"optimizer.{k}", v)
        return
    out.set("optimizer.name", "adamw")
    decay = float(keys.get("weight_decay", 0) or 0)
    for k in ("lr", "betas", "eps", "weight_decay"):
        if k in keys:
            note = None
            if k == "weight_decay" and target.endswith(".Adam") and decay:
                note = ("torch.optim.Adam's L2 penalty becomes AdamW's decoupled decay (not on "
                        "norms and biases): not the same update; retune it")
            out.set(f"optimizer.{k}", float(keys[k]) if k in ("lr", "eps") else keys[k], note)
    if target.endswith(".Adam") and not decay:
        out.notes["optimizer.name"] = "torch.optim.Adam without weight decay is AdamW"
    for k in keys:
        if k not in ("lr", "betas", "eps", "weight_decay"):
            _unmapped(f"optimizer.{k}", out)


def _lr_scheduler(sec: Mapping, out: Converted) -> None:
    """Automodel's scheduler, with the defaults it applies when a key is absent written out."""
    for key, value in sec.items():
        _rename(f"lr_scheduler.{key}", value, out)
    lr = out.get("optimizer.lr")
    steps = out.get("training.max_steps")
    defaults = {"lr_decay_style": "cosine"}
    if steps:
        defaults["lr_warmup_steps"] = min(1000, int(steps) // 10)
    if lr is not None:
        defaults.update(init_lr=float(f"{float(lr) * 0.1:.6g}"),
                        min_lr=float(f"{float(lr) * 0.01:.6g}"))
    for key, value in defaults.items():
        if key not in sec:
            out.set(f"lr_scheduler.{key}", value,
                    f"Automodel's default when {key} is not given, written out")


# -- layout -------------------------------------------------------------------------------------
def _distributed(sec: Mapping, out: Converted) -> None:
    dp = sec.get("dp_size")
    if isinstance(dp, int):
        replicate = int(sec.get("dp_replicate_size") or 1)
        out.set("distributed.dp_shard", dp // replicate,
                f"Automodel's dp_size {dp} over dp_replicate {replicate}; -1 derives it from the "
                "world size")
    for key, value in sec.items():
        if key != "dp_size":
            _rename(f"distributed.{key}", value, out)


def _autopipeline(sec: Mapping, out: Converted) -> None:
    parts = sec.get("module_fqns_per_model_part")
    if parts:
        firsts = []
        for part in parts[1:]:
            layers = [int(m.group(1)) for name in part
                      for m in [re.search(r"(?:^|\.)layers\.(\d+)$", str(name))] if m]
            firsts.append(min(layers) if layers else None)
        pp = int(out.get("distributed.pp", 1) or 1)
        if None in firsts or len(parts) % pp:
            out.leave_out("autopipeline.module_fqns_per_model_part", "not a split by layer "
                          "index: set distributed.pp_split_points by hand")
        else:
            out.set("distributed.pp_split_points", firsts, "the first layer of each stage after "
                    "the first, from module_fqns_per_model_part")
            out.set("distributed.pp_stages_per_rank", len(parts) // pp)
    for key, value in sec.items():
        if key != "module_fqns_per_model_part":
            _rename(f"autopipeline.{key}", value, out)


def _dist_env(sec: Mapping, out: Converted) -> None:
    for key, value in sec.items():
        if key == "backend":
            out.set("distributed.backend", value)
        elif key == "timeout_minutes":
            out.set("distributed.timeout_seconds", int(value) * 60,
                    f"Automodel's timeout_minutes {value}, in seconds")
        elif key.lower().startswith(_ENV_PREFIXES):
            out.set(f"dist_env.{key}", value)
        else:
            out.leave_out(f"dist_env.{key}", "an Automodel switch no hybridtrain code reads; "
                          f"find the equivalent key, if any, in {_REFERENCE}")


# -- trackers, checkpoints ----------------------------------------------------------------------
def _tracker(name: str, sec: Mapping, out: Converted) -> None:
    out.set(f"metrics.{name}", True)
    env = {"entity": "WANDB_ENTITY", "save_dir": "WANDB_DIR"}
    for key, value in sec.items():
        if key in env and name == "wandb":
            out.leave_out(f"wandb.{key}", f"set the environment variable {env[key]}={value}")
        elif key == "tags" and isinstance(value, Mapping):
            out.set("metrics.tags", list(value), "MLflow tag names (their values are left out)")
        else:
            _rename(f"{name}.{key}", value, out)


def _checkpoint(sec: Mapping, out: Converted) -> None:
    for key, value in sec.items():
        if key == "save_consolidated":
            out.set("checkpoint.save_hf_every", bool(value), "Automodel's consolidated "
                    "safetensors at each checkpoint: the HF export in every step_N/ (the "
                    "finished run's export is written anyway: save_hf_at_end)")
        else:
            _rename(f"checkpoint.{key}", value, out)


# -- the generic part ---------------------------------------------------------------------------
def _rename(key: str, value: Any, out: Converted) -> None:
    if key in RENAMES:
        out.set(RENAMES[key], value)
    else:
        _unmapped(key, out)


def _unmapped(key: str, out: Converted) -> None:
    top = key.split(".")[0]
    advice = NOTHING_TO_DO.get(key) or NOTHING_TO_DO.get(top)
    out.leave_out(key, f"nothing to do: {advice}" if advice else
                  f"no hybridtrain equivalent; find a key that does what it did in {_REFERENCE}, "
                  "or leave it out")


def _generic(name: str) -> Callable[[Mapping, Converted], None]:
    def convert_section(sec: Mapping, out: Converted) -> None:
        for key, value in _flat(sec).items():
            _rename(f"{name}.{key}", value, out)
    return convert_section


# sections in the order they are converted (the optimizer's lr before the schedule's defaults)
SECTIONS: dict[str, Callable[[Mapping, Converted], None]] = {
    "step_scheduler": _generic("step_scheduler"),
    "rng": _generic("rng"),
    "dataset": lambda s, o: _dataset("dataset", s, o),
    "validation_dataset": lambda s, o: _dataset("validation_dataset", s, o),
    "packed_sequence": _packing,
    "dataloader": _generic("dataloader"),
    "optimizer": _optimizer,
    "lr_scheduler": _lr_scheduler,
    "clip_grad_norm": _generic("clip_grad_norm"),
    "distributed": _distributed,
    "autopipeline": _autopipeline,
    "compile": _generic("compile"),
    "checkpoint": _checkpoint,
    "dist_env": _dist_env,
    "wandb": lambda s, o: _tracker("wandb", s, o),
    "mlflow": lambda s, o: _tracker("mlflow", s, o),
}


def convert(recipe: Mapping, model_dir: str | None = None) -> Converted:
    """The hybridtrain recipe of a loaded Automodel recipe (``model_dir``: the local model
    folder, instead of ``model.pretrained_model_name_or_path``)."""
    out = Converted()
    peft = recipe.get("peft")
    _model(recipe.get("model") or {}, out, model_dir, lora=bool(peft))
    if peft:
        target = str(peft.get("_target_", "PeftConfig"))
        if not target.endswith("PeftConfig"):
            out.leave_out(f"peft._target_: {target}", "only LoRA converts: hybridtrain's peft "
                          "section (method: lora)")
        out.set("peft.method", "lora")
        for key, value in peft.items():
            if key != "_target_":
                _rename(f"peft.{key}", value, out)
    for name, section in SECTIONS.items():
        if isinstance(recipe.get(name), Mapping):
            section(recipe[name], out)
    for name, value in recipe.items():
        if name in ("model", "peft") or isinstance(value, Mapping) and name in SECTIONS:
            continue
        _unmapped(name, out)
    return out


# -- writing ------------------------------------------------------------------------------------
def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True)
    return text.strip().removesuffix("...").strip()


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}" for line in textwrap.wrap(text, 96 - len(indent))]


def _emit(node: Mapping, notes: Mapping[str, str], prefix: str, depth: int) -> list[str]:
    lines, indent = [], "  " * depth
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if dotted in notes:
            lines += _comment(notes[dotted], indent)
        if isinstance(value, Mapping) and value:
            lines.append(f"{indent}{key}:")
            lines += _emit(value, notes, dotted + ".", depth + 1)
        else:
            lines.append(f"{indent}{key}: {_scalar(value)}")
    return lines


def render(conv: Converted, source: str) -> str:
    """The recipe as YAML: comments above the keys whose meaning changed, the keys left out at
    the end."""
    lines = [f"# Converted from the NeMo Automodel recipe {source} by `hybridtrain import-recipe`.",
             "# A comment above a key says where its meaning differs from Automodel's.", ""]
    for section, body in conv.tree.items():
        lines += _emit({section: body}, conv.notes, "", 0) + [""]
    if conv.left_out:
        lines.append("# Automodel keys with no hybridtrain equivalent (left out):")
        for key, advice in conv.left_out:
            lines += textwrap.wrap(f"{key}: {advice}", 96, initial_indent="#   ",
                                   subsequent_indent="#       ")
    return "\n".join(lines).rstrip() + "\n"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hybridtrain import-recipe", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("source", metavar="AUTOMODEL.yaml", help="the NeMo Automodel recipe")
    parser.add_argument("-o", "--output", metavar="OUT.yaml", default=None,
                        help="where to write the hybridtrain recipe (default: stdout)")
    parser.add_argument("--model-dir", default=None, metavar="DIR",
                        help="the local model folder (default: model.pretrained_model_name_or_"
                             "path when it is a folder, else its Hugging Face cache snapshot)")
    args = parser.parse_args(argv)
    try:
        with open(args.source) as f:
            recipe = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"import-recipe: cannot read {args.source}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"import-recipe: {args.source} is not YAML: {e}") from None
    if not isinstance(recipe, Mapping):
        raise ValueError(f"import-recipe: {args.source} holds no mapping of sections")
    conv = convert(recipe, args.model_dir)
    text = render(conv, os.path.basename(args.source))
    if args.output:
        from hybridtrain.fileio import atomic_write

        atomic_write(args.output, text)
    else:
        sys.stdout.write(text)
    for key, advice in conv.left_out:
        print(f"import-recipe: left out {key}: {advice}", file=sys.stderr)
    if args.output:
        print(f"import-recipe: wrote {args.output} ({len(conv.notes)} keys with a changed "
              f"meaning commented, {len(conv.left_out)} left out)", file=sys.stderr)
    return 0
