"""Every refusal of a recipe's layout and settings, in one pure function.

    dims = validate_run(cfg, world_size, spec, model, device_type)

``finetune``, ``benchmark``, ``dpo`` and ``grpo`` call it through the builder (before anything
is laid out, allocated or loaded) and ``hybridtrain plan`` calls it before it plans, so the plan
refuses exactly the layouts the run refuses, with the same message. It reads the recipe, the
model spec and the model built on the meta device; it builds no process group and allocates
nothing, so a test can walk every refusal through both in one process.
"""

from __future__ import annotations

from torch import nn

from hybridtrain.config.sections import RecipeConfig
from hybridtrain.distributed.activation_checkpoint import parse_ac_policy
from hybridtrain.distributed.layout import parallel_dims_from_config
from hybridtrain.distributed.parallel_dims import ParallelDims
from hybridtrain.distributed.hetero import receiver_degrees
from hybridtrain.distributed.pipeline_layout import check_microbatches, pipeline_layout
from hybridtrain.distributed.parallel_plan import pipeline_split_seq_len
from hybridtrain.models.spec import AuxiliaryLosses, Decoding, HeteroSupport, LayerTypes, LayoutRules, ModelSpec
from hybridtrain.training.step_scheduler import StepScheduler

__all__ = ["validate_run"]


def validate_run(cfg: RecipeConfig, world_size: int, spec: ModelSpec, model: nn.Module,
                 device_type: str, *, train_loop: bool = True, evaluation: bool | None = None
                 ) -> ParallelDims | None:
    """The layout's degrees over ``world_size`` ranks (no meshes built), after checking
    everything the run would refuse about them: the degrees, the family's rules
    (``LayoutRules``), the pipeline split and schedule, the activation-checkpointing policy, an
    encoder on its own ranks; with ``train_loop`` (a training loop over the recipe's batches:
    finetune, plan) also the batch sizes and the pipeline schedule's micro-batches per step;
    with ``evaluation`` (default: ``train_loop`` and an ``evaluation`` section) whether the
    family generates under the layout. ValueError naming the setting and the fix. With
    ``distributed.encoder_ranks`` the checks hold for the model laid out on the other ranks
    (their own degrees), and it returns None (the family's ``HeteroSupport`` plan lays it
    out)."""
    d, t = cfg.distributed, cfg.training
    base_quant = cfg.peft.base_quant if cfg.peft is not None else None
    if base_quant and d.encoder_ranks:
        raise ValueError(f"peft.base_quant: {base_quant} does not run with "
                         "distributed.encoder_ranks; set peft.base_quant: null or encoder_ranks: 0")
    if d.encoder_ranks:  # the checks below hold for the model laid out on the other ranks
        spec.part(HeteroSupport, f"distributed.encoder_ranks={d.encoder_ranks} (an encoder on "
                                 "its own ranks; set it to 0)")
        dims = receiver_degrees(d, d.encoder_ranks, world_size)
    else:
        dims = parallel_dims_from_config(d, world_size, device_type, build_mesh=False)
    rules = spec.find(LayoutRules)
    if rules is not None:
        rules.check(model.config, dims, d, t, device_type)
    parse_ac_policy(t.activation_checkpointing, spec.find(LayerTypes))
    _check_float8(cfg, dims)
    if base_quant:
        _check_base_quant(base_quant, dims)
    aux = spec.find(AuxiliaryLosses)
    if aux is not None and aux.check_layout is not None:
        aux.check_layout(model, dims, d, t)
    schedule = None
    if dims.pp > 1:
        if cfg.packing.padding_free:
            raise ValueError(f"packing.padding_free: true with distributed.pp={dims.pp}: the pipeline "
                             "splits a step's rows into equal micro-batches, and a padding-free "
                             "micro-batch is one row of its own length; set packing.padding_free: false")
        config = model.config
        sched_spec, num_stages, _, _ = pipeline_layout(
            len(spec.pipeline.layers(model)), dims, d,
            spec.flops.layer(config, pipeline_split_seq_len(cfg.packing)), spec.flops.head(config))
        schedule = (sched_spec, num_stages)
    if train_loop:
        _check_train_loop(cfg, dims, schedule)
    if evaluation is None:
        evaluation = train_loop and cfg.evaluation is not None
    if evaluation:
        _check_decoding(spec, dims)
    return None if d.encoder_ranks else dims


def _check_base_quant(base_quant: str, dims: ParallelDims) -> None:
    """An NF4 base (QLoRA) runs in one process and under FSDP2 (data parallel, cp), not split
    by tensor, expert or pipeline parallelism."""
    split = {k: v for k, v in (("tp", dims.tp), ("ep", dims.ep), ("pp", dims.pp)) if v > 1}
    if split:
        raise ValueError(f"peft.base_quant: {base_quant} runs in one process and under FSDP2 "
                         f"(distributed.dp_shard / dp_replicate / cp), not with "
                         f"{', '.join(f'distributed.{k}={v}' for k, v in split.items())}; "
                         "set those to 1 or peft.base_quant: null")


def _check_train_loop(cfg: RecipeConfig, dims: ParallelDims, schedule=None) -> None:
    """The batch sizes over the data-parallel ranks (the run's scheduler refuses them) and,
    with ``schedule`` (the pipeline's schedule spec and number of stages), the micro-batches
    each step gives the pipeline."""
    d, t = cfg.distributed, cfg.training
    sched = StepScheduler(t.global_batch_size, t.micro_batch_size, dp_size=dims.dp, max_steps=1)
    if schedule is not None:
        local = sched.micro_batch_size * sched.grad_acc_steps
        if d.pp_microbatch_size and local % d.pp_microbatch_size:
            raise ValueError(
                f"pipeline: the local batch of {local} samples (micro_batch_size × "
                f"gradient accumulation) is not divisible by distributed.pp_microbatch_size="
                f"{d.pp_microbatch_size}")
        n_micro = local // d.pp_microbatch_size if d.pp_microbatch_size else sched.grad_acc_steps
        try:
            check_microbatches(*schedule, dims.pp, n_micro)
        except ValueError as e:
            raise ValueError(
                f"{e} (the {local} rows of a step on each of the {dims.dp} data-parallel ranks); "
                "give the pipeline more micro-batches per step: raise training.global_batch_size "
                "or lower training.micro_batch_size (or distributed.pp_microbatch_size)") from None


def _check_float8(cfg: RecipeConfig, dims: ParallelDims) -> None:
    """``training.float8`` with what it is not tested with here."""
    t = cfg.training
    if t.float8 is None:
        return
    if cfg.peft is not None:
        raise ValueError("training.float8 with a peft section: LoRA wraps the Linear layers "
                         "float8 converts; set training.float8: null")
    if cfg.evaluation is not None:
        raise ValueError("training.float8 with an evaluation section: decoding runs under "
                         "torch.inference_mode, where torchao 0.18's float8 layers fail under "
                         "autocast; remove the evaluation section or set training.float8: null")
    if dims.cp > 1:
        raise ValueError("training.float8 is not available with context parallelism yet "
                         "(distributed.cp > 1); set training.float8: null or distributed.cp: 1")


def _check_decoding(spec: ModelSpec, dims: ParallelDims) -> None:
    """The evaluation (answers by generation) under ``dims``."""
    decoding = spec.part(Decoding, "the evaluation section (answers by generation; remove "
                                   "the section)")
    if dims.pp > 1 and not decoding.pipeline:
        raise ValueError(f"evaluation: the model spec {spec.name!r} does not decode through "
                         "pipeline stages (its Decoding part); remove the evaluation section "
                         "or set distributed.pp: 1")
    if dims.world_size > 1 and not decoding.lockstep:
        raise ValueError(f"evaluation: the model spec {spec.name!r} does not decode on "
                         "several ranks in lockstep (its Decoding part); remove the "
                         "evaluation section or run on one process")
