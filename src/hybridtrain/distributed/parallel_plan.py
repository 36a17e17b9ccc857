"""From a model and a layout to what one rank trains: :func:`parallelize` -> :class:`ParallelPlan`.

    pipeline split (spec.pipeline.stage) -> spec.parallelize_fn on every stage
    (TP -> EP -> activation checkpointing -> compile -> FSDP2)

Every run goes through it, one process included (degrees of 1 do nothing), so the code a
default run executes is the code the layout-parity tests cover.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hybridtrain.config.sections import DistributedSection, PackingSection, TrainingSection
from hybridtrain.distributed.fsdp import fsdp_param_dtype
from hybridtrain.distributed.parallel_dims import ParallelDims
from hybridtrain.distributed.pipeline import PipelineTrainStep
from hybridtrain.distributed.pipeline_layout import pipeline_layout
from hybridtrain.distributed.utils import clip_grad_norm_

logger = logging.getLogger(__name__)

__all__ = ["Plan", "ParallelPlan", "parallelize", "pipeline_split_seq_len", "recipe_seq_len"]


class Plan(Protocol):
    """What every layout's plan answers (:class:`ParallelPlan`, and
    :class:`~hybridtrain.distributed.hetero.HeteroPlan` for an encoder on its own ranks):
    ``model``, ``stages``, ``dims``, ``pipeline``, ``device`` and ``autocast_dtype`` as
    :class:`ParallelPlan` says; ``data_view(dataset, batch_sampler, collate) -> (dataset,
    batch_sampler, collate)``: what this rank reads of each batch (None: the whole batch);
    ``sharded``: ``model`` is one FSDP2 module that a step without pipeline tells, per
    micro-batch, whether to reduce its gradients (``set_requires_gradient_sync``: only after the
    last); ``clip_grad_norm(parameters, max_norm)``: the global gradient norm, clipping by it."""

    model: nn.Module
    stages: list
    dims: Any
    pipeline: Any
    device: torch.device
    autocast_dtype: torch.dtype | None
    data_view: Callable | None

    @property
    def sharded(self) -> bool: ...

    def clip_grad_norm(self, parameters, max_norm: float | None,
                       norm_type: float = 2.0) -> torch.Tensor: ...


@dataclass
class ParallelPlan:
    """What this rank trains.

    * ``model``: this rank's part of the model (the whole model without pipeline parallelism;
      under it, the model holding only this rank's stages' parts, with unchanged parameter
      names). The optimizer, clipping and checkpoints use it; a checkpoint written under one
      layout loads under any other.
    * ``stages``: the modules a step runs (``[model]`` without PP; this rank's pipeline stages).
    * ``pipeline``: the schedule step under PP, else None.
    * ``device`` / ``autocast_dtype``: where this rank computes, and the autocast dtype of its
      forward and backward (None: the parameters' dtype).
    * ``data_view``: None (every rank of a layout reads its data-parallel share of each batch).
    """

    model: nn.Module
    stages: list[nn.Module]
    dims: ParallelDims
    pipeline: PipelineTrainStep | None = None
    device: torch.device = torch.device("cpu")
    autocast_dtype: torch.dtype | None = None
    data_view: Callable | None = None

    @property
    def sharded(self) -> bool:
        """``model`` is one FSDP2 module (data parallelism without pipeline stages; under
        pipeline parallelism the pipeline step syncs the sharded stages itself)."""
        return self.pipeline is None and self.dims.fsdp_enabled

    @classmethod
    def single(cls, model: nn.Module, device: torch.device | str = "cpu",
               autocast_dtype: torch.dtype | None = None) -> "ParallelPlan":
        """The plan of one process training all of ``model`` (nothing laid out)."""
        return cls(model=model, stages=[model], dims=ParallelDims(), device=torch.device(device),
                   autocast_dtype=autocast_dtype)

    def clip_grad_norm(self, parameters, max_norm: float | None, norm_type: float = 2.0):
        """Global gradient norm (all meshes, all pipeline stages); clips when ``max_norm``."""
        pp_group = self.dims.group("pp") if self.dims.pp > 1 else None
        return clip_grad_norm_(parameters, max_norm, norm_type, pp_group=pp_group)


def recipe_seq_len(cfg) -> int:
    """The row length of a recipe's batches (``cfg``: a ``RecipeConfig``): the packed length,
    else the dataset's ``seq_length``, else 2048 (what ``benchmark`` and ``plan`` assume)."""
    if cfg.packing.enabled:
        return int(cfg.packing.pack_size)
    if cfg.dataset is not None and cfg.dataset.get("seq_length"):
        return int(cfg.dataset["seq_length"])
    return 2048


def pipeline_split_seq_len(packing: PackingSection) -> int:
    """The row length the pipeline split balances per-layer FLOPs at (``packing``: the
    recipe's section): the packed length, else 2048. The run and ``hybridtrain plan`` both ask
    this."""
    return int(packing.pack_size) if packing.enabled else 2048


def parallelize(spec, model: nn.Module, dims: ParallelDims,
                distributed: DistributedSection, training: TrainingSection, *,
                device: torch.device, autocast_dtype: torch.dtype | None,
                seq_len: int = 2048) -> ParallelPlan:
    """Lay ``model`` (identically initialised on every rank) out over ``dims``.

    ``distributed`` / ``training``: the recipe's typed sections
    (:func:`~hybridtrain.config.sections.config_section` makes one from a few keys).
    ``seq_len``: the row length the pipeline split balances the per-layer FLOPs at."""
    assert isinstance(distributed, DistributedSection) and isinstance(training, TrainingSection), \
        "parallelize takes the typed sections (hybridtrain.config.sections)"
    device = torch.device(device)
    if dims.world_size > 1:
        assert dims.built, "ParallelDims.build_mesh() must run before parallelize"
    config = model.config
    layer_names = spec.pipeline.layers(model)
    if dims.pp > 1:
        sched, num_stages, ranges, stage_ids = pipeline_layout(
            len(layer_names), dims, distributed, spec.flops.layer(config, seq_len),
            spec.flops.head(config))
        stages = [spec.pipeline.stage(model, layer_names[slice(*ranges[s])], s == 0,
                                      s == num_stages - 1) for s in stage_ids]
        mine = [n for s in stage_ids for n in layer_names[slice(*ranges[s])]]
        model = spec.pipeline.stage(model, mine, 0 in stage_ids, num_stages - 1 in stage_ids)
        logger.info("pipeline: %d stages, layer ranges %s; this rank runs stages %s (%s)",
                    num_stages, ranges, stage_ids, sched.name)
    else:
        stages = [model]
    for stage in stages:
        spec.parallelize_fn(stage, dims, distributed, training, device=device,
                            autocast_dtype=autocast_dtype)
    pipeline = None
    if dims.pp > 1:
        if sched.split_backward:  # zero-bubble: back-propagates twice through the loss
            model.loss.recompute = True
        param_dtype = fsdp_param_dtype(distributed, autocast_dtype)
        hidden_dtype = param_dtype if dims.fsdp_enabled and param_dtype is not None else \
            next(model.parameters()).dtype  # the dtype the stages compute and exchange in
        pipeline = PipelineTrainStep(
            stages, stage_ids, num_stages, dims.group("pp"), device,
            hidden_size=spec.pipeline.hidden_size(config), hidden_dtype=hidden_dtype,
            carried_size=spec.pipeline.carried_size(model) if spec.pipeline.carried_size else 0,
            schedule=distributed.pp_schedule, microbatch_size=distributed.pp_microbatch_size,
            row_inputs=spec.pipeline.row_inputs and functools.partial(spec.pipeline.row_inputs,
                                                                      config),
            shape_group=dims.ranks_group)
    plan = ParallelPlan(model=model, stages=stages, dims=dims, pipeline=pipeline, device=device,
                        autocast_dtype=autocast_dtype)
    assert plan.sharded == isinstance(model, FSDPModule) or pipeline is not None, \
        f"{spec.name}: parallelize_fn must apply FSDP2 to the model's root exactly when " \
        "dims.fsdp_enabled"
    return plan
