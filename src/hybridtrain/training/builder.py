"""Builds a recipe's parts: tokenizer, model (meta device, laid out, then materialised per
rank), LoRA, data, optimizer, checkpointer and trainer. Every command that runs a
model from a recipe (``finetune``, ``benchmark``, ``evaluate``, the RL :class:`~hybridtrain.rl.Policy`)
composes these; the commands themselves live in :mod:`hybridtrain.recipes`.

    from hybridtrain.training.builder import build
    b = build("examples/squad_tiny.yaml")   # Built: model, plan, optimizer, data, ...

:func:`build` reads the recipe as typed sections
(:class:`~hybridtrain.config.sections.RecipeConfig`, made once from a path, a loaded ``ConfigNode``
or a dict); ``Built.cfg`` is that object.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from hybridtrain.config import ConfigNode, instantiate, resolve_target
from hybridtrain.config.dist_env import gemm_kernel_cache_defaults
from hybridtrain.config.sections import RecipeConfig, recipe_config
from hybridtrain.data import build_collator, load_tokenizer, pack_dataset
from hybridtrain.data.contract import check_dataset
from hybridtrain.data.io import DataError
from hybridtrain.distributed.layout import parallel_dims_from_config
from hybridtrain.distributed.materialize import InitUnit, materialize, module_init_units
from hybridtrain.distributed.parallel_plan import (
    ParallelPlan, Plan, parallelize, pipeline_split_seq_len,
)
from hybridtrain.distributed.utils import main_process_first
from hybridtrain.models.spec import (
    AuxiliaryLosses, ExpertRouting, HeteroSupport, MetaInit, ModelSpec, PeftSupport, model_spec_for,
    set_train_loss,
)
from hybridtrain.ops.backend import configure_backend
from hybridtrain.ops.aux_loss import AuxiliaryLoss
from hybridtrain.ops.expert_load import ExpertLoad
from hybridtrain.ops.loss import LinearCrossEntropy
from hybridtrain.peft.export import export_peft, save_merged_hf
from hybridtrain.peft.lora import adapter_init_units, apply_lora, base_weight_shapes, quantize_base
from hybridtrain.peft.quant import packer
from hybridtrain.training.checkpoint import Checkpointer
from hybridtrain.training.float8 import block_names, convert_to_float8, precompute_scales
from hybridtrain.training.hf_export import default_export
from hybridtrain.training.evaluation import evaluator_from_config
from hybridtrain.training.validate import validate_run
from hybridtrain.training.flops import Throughput, peak_tflops
from hybridtrain.training.lr_schedule import LRScheduler
from hybridtrain.training.metrics import MetricsLogger
from hybridtrain.training.optim import build_optimizer, param_groups
from hybridtrain.training.precision import (
    autocast_dtype as autocast_dtype_of, resolve_dtype, resolve_save_dtype,
)
from hybridtrain.training.preemption import RunStop
from hybridtrain.training.rng import seed_all
from hybridtrain.training.settings import trainer_settings
from hybridtrain.training.step_scheduler import StepScheduler
from hybridtrain.training.trainer import TrainData, Trainer

logger = logging.getLogger(__name__)

# -- helpers ----------------------------------------------------------------------------------
def as_config(cfg: Any) -> ConfigNode:
    """The loaded recipe tree of ``cfg`` (a path, a ``ConfigNode``, a dict, a ``RecipeConfig``)."""
    return cfg if isinstance(cfg, ConfigNode) else recipe_config(cfg).node


def instantiate_with(node, *, to_var_kw: bool = True, **offered):
    """``instantiate(node, **kw)`` where ``kw`` are the ``offered`` arguments the target takes
    and the recipe does not set itself (e.g. the tokenizer object for a dataset builder); a
    target's ``**kwargs`` takes them too unless ``to_var_kw`` is false."""
    if node is None:
        return None
    try:
        params = inspect.signature(resolve_target(node["_target_"],
                                                  node.target_prefixes())).parameters
    except (TypeError, ValueError, KeyError):
        params = {}
    var_kw = to_var_kw and any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw = {k: v for k, v in offered.items() if (k in params or var_kw) and k not in node}
    return instantiate(node, **kw)


def build_dataset(node: ConfigNode | None, section: str, **offered):
    """The dataset a recipe section builds (``instantiate_with(node, **offered)``), checked
    against the data contract (:func:`hybridtrain.data.contract.check_dataset`); ``None`` for
    no section."""
    if node is None:
        return None
    return check_dataset(instantiate_with(node, **offered),
                         f"{section} ({node.where('_target_')}: {node.get('_target_')})")


def build_on_meta(model_node: ConfigNode) -> nn.Module:
    """The model of a recipe's model section built on the meta device (the target gets
    ``device="meta"`` when it takes it): the one meta-device build, of the run (materialised
    after its layout) and of ``hybridtrain plan`` (never materialised). A target that ignores
    the meta device returns a model with real tensors."""
    with torch.device("meta"):
        return instantiate_with(model_node, to_var_kw=False, device="meta")


def _build_tokenizer(cfg: RecipeConfig, is_main: bool):
    node = cfg.tokenizer
    if node is None:
        return None
    if not str(node.get("_target_", "")).endswith("build_bpe_tokenizer"):
        return instantiate(node)
    # rank 0 trains and saves it; the others load the saved files instead of training again
    build = (lambda: instantiate(node)) if is_main else (lambda: load_tokenizer(node["out_dir"]))
    return main_process_first(build, is_main)


# a Hugging Face tokenizer folder holds at least one of these
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_input_paths(cfg: RecipeConfig | ConfigNode,
                      sections: tuple[str, ...] = ("tokenizer", "dataset", "validation_dataset")
                      ) -> None:
    """Fails before anything is built when a local input the recipe names is missing: a
    dataset's ``path`` (a file, a folder or a glob; not one a nested ``_target_`` writes), a
    ``chat_template_path``, a loaded tokenizer's folder."""
    import glob

    for section in sections:
        node = getattr(cfg, section, None)
        if not isinstance(node, Mapping):
            continue
        is_tokenizer = str(node.get("_target_", "")).endswith("load_tokenizer")
        for key, kind in (("path", "folder" if is_tokenizer else "data file, folder or glob"),
                          ("chat_template_path", "file")):
            value = node.get(key)
            if not isinstance(value, str) or not value:
                continue
            path = os.path.expanduser(value)
            found = os.path.isdir(path) if is_tokenizer and key == "path" else (
                os.path.exists(path) or (key == "path" and bool(glob.glob(path))))
            if not found:
                raise DataError(f"{node.where(key)}: {section}.{key} {value!r}: no such {kind} "
                                f"(relative paths are read from {os.getcwd()})")
            if is_tokenizer and key == "path" and not any(
                    os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
                raise DataError(f"{node.where(key)}: {section}.{key} {value!r} holds no tokenizer "
                                f"(none of {', '.join(_TOKENIZER_FILES)}); point it at the model's "
                                "folder (a recipe's ${env:VAR,default} names the variable to set)")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _flops_fn(spec, model_config, loss_chunk_size):
    """Training FLOPs of a collated batch (the spec's count; the LM head on label tokens only
    when the chunked loss is on: it gives logits to nothing else)."""
    return functools.partial(spec.flops.batch, model_config,
                             head_on_label_tokens_only=loss_chunk_size is not None)


def _peak_tflops(cfg: RecipeConfig, device: torch.device, dtype: torch.dtype) -> float | None:
    if cfg.metrics.peak_tflops:
        return float(cfg.metrics.peak_tflops)
    try:
        return peak_tflops(device, dtype)
    except ValueError as e:
        logger.warning("no peak TFLOP/s for MFU: %s", e)
        return None


# -- parallel layout --------------------------------------------------------------------------
def _parallelize(cfg: RecipeConfig, spec: ModelSpec, model, world_size: int,
                 device: torch.device, autocast_dtype, dims=None) -> ParallelPlan:
    """The ``distributed:`` layout (and activation checkpointing / compile) of ``model``: the
    same path for one process and many (``dims``: its degrees, default the section's over
    ``world_size`` ranks)."""
    if dims is None:
        dims = parallel_dims_from_config(cfg.distributed, world_size, device.type)
    return parallelize(spec, model, dims, cfg.distributed, cfg.training, device=device,
                       autocast_dtype=autocast_dtype, seq_len=pipeline_split_seq_len(cfg.packing))


def _weight_source(model: nn.Module, seed: int) -> dict:
    """Where a meta-device model's weights come from: its checkpoint (``from_pretrained``
    records ``name_or_path``), else a seeded random initialisation of an untouched copy."""
    src = model.name_or_path
    return {"checkpoint": src, "names": set(model.state_dict()), "seed": seed,
            "twin": None if src else copy.deepcopy(model)}


def _materialize(spec, model: nn.Module, device: torch.device, source: dict) -> None:
    """Allocate and fill this rank's shards of the laid-out meta-device ``model``."""
    units = [InitUnit(*u) for u in adapter_init_units(model)]
    meta = spec.part(MetaInit, "building the model on the meta device")
    read = None
    if source["checkpoint"]:
        if meta.hf_slice_reader is None:
            raise ValueError(f"model spec {spec.name!r}: its MetaInit part has no hf_slice_reader "
                             f"to read {source['checkpoint']} shard by shard")
        read = meta.hf_slice_reader(source["checkpoint"])
    else:
        twin = source["twin"]
        units += module_init_units(twin, meta.init_units(twin))
    t0 = time.perf_counter()
    materialize(model, device, read=read, read_names=source["names"], units=units,
                seed=source["seed"], pack=packer(base_weight_shapes(model)))
    logger.info("materialised this rank's weights (%s) in %.1fs",
                source["checkpoint"] or f"random init, seed {source['seed']}",
                time.perf_counter() - t0)


# -- data, optimizer --------------------------------------------------------------------------
def _build_data(cfg: RecipeConfig, tokenizer, is_main: bool, device: torch.device) -> TrainData:
    """The datasets (+ packing) and their ``make_loader(dataset, batch_sampler, view=None)``."""
    if cfg.dataset is None:
        raise ValueError(f"the recipe has no dataset section ({cfg.source_file})")
    # rank 0 first: it writes files and fills the datasets cache the others then read
    # default_split: which files of a directory holding several splits each section reads
    train_ds = main_process_first(
        lambda: build_dataset(cfg.dataset, "dataset", tokenizer=tokenizer, default_split="train"),
        is_main)
    val_ds = main_process_first(
        lambda: build_dataset(cfg.validation_dataset, "validation_dataset", tokenizer=tokenizer,
                              default_split="validation"), is_main)
    if cfg.packing.enabled:
        if cfg.packing.split_across_pack:
            raise ValueError("packing.split_across_pack is not supported; set it to false")
        train_ds = pack_dataset(train_ds, cfg.packing.pack_size,
                                pad_to_multiple_of=cfg.packing.pad_to_multiple_of)
        if cfg.packing.max_packs:
            train_ds = torch.utils.data.Subset(train_ds, range(min(cfg.packing.max_packs,
                                                                   len(train_ds))))
            train_ds.pad_token_id = train_ds.dataset.pad_token_id
        logger.info("packing: %d rows of %d tokens", len(train_ds), cfg.packing.pack_size)
    base_train = train_ds.dataset if isinstance(train_ds, torch.utils.data.Subset) else train_ds
    collators = {id(train_ds): build_collator(base_train, padding_free=cfg.packing.padding_free)}
    if val_ds is not None:
        collators[id(val_ds)] = build_collator(val_ds)
    pin = cfg.dataloader.pin_memory and device.type == "cuda"

    def make_loader(dataset, batch_sampler, view=None):
        collate = collators[id(dataset)]
        if view is not None:  # what this rank reads of each batch (a plan's data_view)
            dataset, batch_sampler, collate = view(dataset, batch_sampler, collate)
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate,
                          num_workers=cfg.dataloader.num_workers, pin_memory=pin,
                          generator=torch.Generator())  # never draws from the global RNG

    return TrainData(train=train_ds, make_loader=make_loader, val=val_ds)


def build_lr_scheduler(cfg: RecipeConfig | ConfigNode, optimizer, max_steps: int | None,
                       global_batch_size: int):
    """The ``lr_scheduler:`` section over a run of ``max_steps`` steps of ``global_batch_size``
    samples (the decay length when the section gives none). Without an ``optimizer`` (nothing
    trainable on this rank) it only follows the run, at the ``optimizer:`` section's lr."""
    cfg = recipe_config(cfg)
    if isinstance(cfg.lr_scheduler, ConfigNode):  # a _target_ mapping
        return instantiate(cfg.lr_scheduler, optimizer)
    total_samples = max_steps * global_batch_size if max_steps else None
    kw = cfg.lr_scheduler.to_dict()
    if optimizer is None and kw.get("lr") is None:
        kw["lr"] = getattr(cfg.optimizer, "lr", 0.0)
    return LRScheduler(optimizer, **kw, total_steps=max_steps, total_samples=total_samples)


def _build_optimizer(cfg: RecipeConfig, model, device: torch.device):
    """The ``optimizer:`` section over this rank's trainable parameters, or None on a rank that
    holds none (a frozen module on its own ranks, a frozen pipeline stage): no optimizer and
    no optimizer state there. A model with nothing to train on any rank is an error."""
    local = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = torch.tensor([float(local)], dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    if not total.item():
        raise ValueError(f"{cfg.model.where()}: the model has no trainable parameters (every "
                         "module frozen: model.freeze / requires_grad=False); unfreeze one")
    if not local:
        logger.info("no trainable parameter on this rank: no optimizer here")
        return None
    if isinstance(cfg.optimizer, ConfigNode):  # a _target_ mapping
        wd = cfg.optimizer.get("weight_decay", 0.0)
        return instantiate(cfg.optimizer, param_groups(model, wd))
    o = cfg.optimizer
    return build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas,
                           eps=o.eps, implementation=o.implementation, name=o.name)


# -- build ------------------------------------------------------------------------------------
@dataclass
class Built:
    """What :func:`build` makes of a recipe: the parts a training loop runs with (the loop's
    step scheduler, LR schedule, checkpoints and metrics are the caller's)."""

    cfg: RecipeConfig
    device: torch.device
    is_main: bool
    tokenizer: Any
    model: nn.Module  # the model this rank trains (the plan's: under PP, this rank's part)
    model_config: Any
    spec: ModelSpec
    num_params: int  # of the whole model (before any parallel layout)
    dtype: torch.dtype  # compute dtype; parameters and optimizer state stay as built (fp32)
    save_dtype: torch.dtype  # dtype of the HF export
    peft: dict | None
    plan: Plan  # model, stages, coordinates, device, autocast dtype
    optimizer: torch.optim.Optimizer | None  # None: nothing trainable on this rank
    flops_fn: Callable[[dict], float] | None
    data: TrainData | None = None  # None when built with data=False
    aux_loss: AuxiliaryLoss | None = None  # the model's extra objectives (spec's AuxiliaryLosses)
    expert_load: ExpertLoad | None = None  # its MoE routers' load (spec's ExpertRouting)
    after_update: Callable[[nn.Module], None] | None = None  # run after each optimizer step


def build(cfg: Any, device: torch.device | str | None = None, is_main: bool = True,
          world_size: int = 1, *, data: bool = True, dtype: str | None = None,
          loss: nn.Module | None = None, tokenizer: bool | None = None,
          train_loop: bool = False, evaluation: bool | None = None,
          check_model: Callable[[nn.Module, dict | None], None] | None = None) -> Built:
    """Builds a recipe's parts in a fixed order: seeds -> input paths checked
    (:func:`check_input_paths`) -> tokenizer -> model (random init from
    a config, or ``from_pretrained``) -> compute dtype and backend tuning -> LoRA (``peft:``) -> datasets (+ packing) -> parallel
    layout -> optimizer.

    ``device`` / ``is_main`` / ``world_size``: this process (``init_distributed``'s; default
    ``training.device``, one process). ``data=False`` builds no datasets (and no tokenizer unless ``tokenizer``).
    ``dtype`` replaces ``training.dtype``. ``loss``: the module ``model(..., labels=)`` returns
    through (default: the summing chunked cross-entropy of ``training.loss_chunk_size``).
    The recipe is checked by :func:`~hybridtrain.training.validate.validate_run` before the
    layout is built (``train_loop``: also what a training loop over the recipe's batches and
    its ``evaluation`` section need, as ``finetune`` runs them; ``evaluation``: whether the
    model generates under the layout, default with ``train_loop`` and an ``evaluation``
    section). ``check_model(model, peft)``: called on the model (with its LoRA adapters,
    before the layout) before the datasets are built, e.g. to refuse a checkpoint to resume.
    ``cfg``: a :class:`~hybridtrain.config.sections.RecipeConfig` (or a path, a ``ConfigNode``
    or a dict, made into one here).
    """
    cfg = recipe_config(cfg)
    # a library user's process gets the CLI's bounds of oneDNN's CPU GEMM kernel caches, if no
    # oneDNN kernel was built in it yet (config/dist_env.py)
    gemm_kernel_cache_defaults()
    t = cfg.training
    device = resolve_device(t.device) if device is None else torch.device(device)
    seed_all(t.seed)
    if t.deterministic:
        torch.use_deterministic_algorithms(True)

    # inputs first (a missing file is reported before minutes of building), tokenizer, model
    with_tokenizer = data if tokenizer is None else tokenizer
    check_input_paths(cfg, (("tokenizer",) if with_tokenizer else ())
                      + (("dataset", "validation_dataset") if data else ()))
    tokenizer = _build_tokenizer(cfg, is_main) if with_tokenizer else None
    if cfg.model is None:
        raise ValueError(f"the recipe has no model section ({cfg.source_file})")
    torch.manual_seed(t.seed)
    model = build_on_meta(cfg.model)  # materialised after the layout
    on_meta = all(p.is_meta for p in model.parameters())
    if not on_meta and any(p.is_meta for p in model.parameters()):
        # a target that built only part of itself on the meta device: build it in full
        logger.info("%s: the model target does not build on the meta device; building it in "
                    "full on every rank", cfg.model.where())
        model = instantiate_with(cfg.model)
    spec = model_spec_for(model)
    spec.check_model(model)
    aux_part = spec.find(AuxiliaryLosses)  # e.g. training.mtp: train, freeze or drop the layers
    aux_loss = aux_part.setup(model, t) if aux_part is not None else None
    routing = spec.find(ExpertRouting)  # the routers' load each step, their bias update
    expert_load = routing.setup(model, t) if routing is not None else None
    model_config = model.config
    compute_dtype = resolve_dtype(dtype or t.dtype, device, model_config.hidden_size, t.cpu_bf16)
    configure_backend(device, compute_dtype, cpu_allocator=t.cpu_allocator, grouped_mm=t.grouped_mm,
                      fused_loss=t.fused_loss, mamba_kernels=t.mamba_kernels)
    autocast_dtype = autocast_dtype_of(compute_dtype)
    save_dtype = resolve_save_dtype(cfg.checkpoint.save_dtype, model)  # before LoRA / sharding
    if tokenizer is not None and len(tokenizer) > model_config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but model.config.vocab_size is "
            f"{model_config.vocab_size} ({cfg.model.where()}); raise the model's vocab_size or "
            "use a smaller tokenizer")
    source = _weight_source(model, t.seed) if on_meta else None
    peft = None
    if cfg.peft is not None:
        peft = cfg.peft.to_dict()
        apply_lora(model, **{k: v for k, v in peft.items() if k != "base_quant"})
    if check_model is not None:
        check_model(model, peft)
    if not on_meta:  # a model target that ignored the meta device: built in full already
        model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info("model %s: %s parameters (%s trainable) on %s", type(model).__name__,
                f"{n_params:,}", f"{n_train:,}", device)

    train_data = _build_data(cfg, tokenizer, is_main, device) if data else None

    # training loss, parallel layout, optimizer
    set_train_loss(model, loss if loss is not None else
                   LinearCrossEntropy(chunk_size=t.loss_chunk_size, reduction="sum"))
    dims = validate_run(cfg, world_size, spec, model, device.type, train_loop=train_loop,
                        evaluation=evaluation)
    after_update = None
    if t.float8 is not None:  # before the layout (torchtitan's order)
        float8 = convert_to_float8(
            model, t.float8, block_names(model, spec.pipeline.layers(model)), t.float8_filter,
            emulate=device.type != "cuda", expert_modules=_expert_modules(spec),
            experts_off=_float8_experts_off(t, device, compute_dtype, dims),
            float8_all_gather=t.float8 == "tensorwise" and dims.fsdp_enabled)
        after_update = precompute_scales if float8.float8_all_gather else None
    if peft is not None and peft["base_quant"]:  # QLoRA: NF4 blocks that FSDP2 can split
        quantize_base(model, peft["base_quant"], shards=dims.dp_shard_cp)
    if cfg.distributed.encoder_ranks:
        plan = spec.find(HeteroSupport).plan(
            model, cfg.distributed, world_size, device=device, autocast_dtype=autocast_dtype,
            parallelize=lambda m, dims: _parallelize(cfg, spec, m, world_size, device,
                                                     autocast_dtype, dims))
    else:
        plan = _parallelize(cfg, spec, model, world_size, device, autocast_dtype)
    model = plan.model
    if train_data is not None and plan.data_view is not None:
        train_data = dataclasses.replace(train_data, make_loader=functools.partial(
            train_data.make_loader, view=plan.data_view))
    if source is not None:  # FSDP2's CPU offload keeps the shards in host memory
        _materialize(spec, model, "cpu" if cfg.distributed.cpu_offload else device, source)
    return Built(
        cfg=cfg, device=device, is_main=is_main, tokenizer=tokenizer, model=model,
        model_config=model_config, spec=spec, num_params=n_params, dtype=compute_dtype,
        save_dtype=save_dtype, peft=peft, plan=plan,
        optimizer=_build_optimizer(cfg, model, device),
        flops_fn=_flops_fn(spec, model_config, t.loss_chunk_size), data=train_data,
        aux_loss=aux_loss, expert_load=expert_load, after_update=after_update)


def _expert_modules(spec: ModelSpec) -> tuple[type[nn.Module], ...]:
    """The spec's classes of stacked-expert modules (its LoRA part names them)."""
    peft = spec.find(PeftSupport)
    return peft.expert_modules if peft is not None else ()


def _float8_experts_off(t, device: torch.device, dtype: torch.dtype, dims) -> str | None:
    """Why the routed experts stay high-precision under ``training.float8`` here (None: they
    take torchao's float8 grouped GEMM, which runs on CUDA in the grouped expert path)."""
    if device.type != "cuda":
        return ("on this device: torchao's float8 grouped GEMM needs CUDA (its Triton casts and "
                "torch._scaled_grouped_mm)")
    if t.grouped_mm is False or dtype != torch.bfloat16:
        return "outside the bf16 grouped expert path (training.grouped_mm / training.dtype)"
    if dims.ep > 1 or dims.tp > 1:
        return "under expert or tensor parallelism (not wired to torchao's float8 grouped GEMM)"
    return None


def _export_lora(model, step_dir: str, tokenizer, final: bool, *, base, merged: bool, dtype):
    """A LoRA run's export: the PEFT adapter, and with ``merged`` the merged HF model at the end."""
    export_peft(model, os.path.join(step_dir, "adapter"), base, tokenizer)
    if final and merged:
        save_merged_hf(model, os.path.join(step_dir, "merged_hf"), tokenizer, dtype=dtype)


def build_checkpointer(b: Built, out_dir: str) -> Checkpointer:
    """The ``checkpoint:`` section's :class:`Checkpointer` of ``out_dir`` for what :func:`build`
    made (a LoRA run exports its adapter and records its settings)."""
    ck = b.cfg.checkpoint
    export_fn, state_extra = functools.partial(default_export, dtype=b.save_dtype), {}
    if b.peft is not None:
        base = b.cfg.model.get("local_dir")
        if base is not None and not isinstance(base, str):  # a target that wrote the folder
            base = getattr(b.model, "name_or_path", None)
        state_extra = {"peft": b.peft, "base_model_name_or_path": base}
        export_fn = functools.partial(_export_lora, base=base, merged=ck.save_merged_hf,
                                      dtype=b.save_dtype)
    return Checkpointer(out_dir, keep_last=ck.keep_last, save_hf=ck.save_hf_every,
                        export_fn=export_fn, state_extra=state_extra, tokenizer=b.tokenizer)


def make_evaluator(b: Built, section=None, dataset=None, tokenizer=None):
    """The ``evaluation:`` section's :class:`~hybridtrain.training.evaluation.GenerationEvaluator`
    on what :func:`build` made (its layout: data-parallel split, lockstep, pipeline chain);
    ``section`` / ``dataset`` / ``tokenizer`` default to the recipe's."""
    cfg = b.cfg
    return evaluator_from_config(
        cfg.evaluation if section is None else section,
        (b.data.val if b.data is not None else None) if dataset is None else dataset,
        b.tokenizer if tokenizer is None else tokenizer, os.path.abspath(cfg.checkpoint.dir),
        autocast_dtype=b.plan.autocast_dtype, dims=b.plan.dims, pipeline=b.plan.pipeline,
        is_main=b.is_main)


def make_trainer(b: Built, step_scheduler: StepScheduler, lr_scheduler,
                 checkpointer: Checkpointer | None = None,
                 metrics: MetricsLogger | None = None, started: float | None = None) -> Trainer:
    """The recipe's :class:`Trainer` over what :func:`build` made (its plan, data, optimizer,
    FLOPs count) with these schedulers, checkpoints and metrics; it stops early on
    ``checkpoint.save_on_signal`` and ``training.max_time`` (counted from ``started``, a
    ``time.perf_counter()``; default: now)."""
    cfg = b.cfg
    assert b.data is not None, "make_trainer needs what build(..., data=True) made"
    return Trainer(
        b.plan, b.optimizer, lr_scheduler, step_scheduler, b.data,
        trainer_settings(cfg.training, cfg.checkpoint), checkpointer=checkpointer,
        metrics=metrics, throughput=Throughput(b.flops_fn, _peak_tflops(cfg, b.device, b.dtype)),
        evaluator=make_evaluator(b) if cfg.evaluation is not None else None,
        stop=RunStop.from_config(cfg, b.device, started), aux_loss=b.aux_loss,
        expert_load=b.expert_load, after_update=b.after_update)
