"""How Nemotron-H parallelizes itself: one function, a fixed order (as torchtitan).

    pipeline split -> TP (not yet) -> EP -> activation checkpointing -> compile -> FSDP2

:func:`parallelize_nemotron_h` returns a :class:`ParallelPlan`:

* ``plan.model`` -- the model this rank trains: the whole model, or under pipeline parallelism
  the same ``NemotronHForCausalLM`` with only this rank's layers (``backbone.layers`` is a dict
  keyed by the global layer index, so parameter names never change; the embeddings live on the
  rank of the first stage, ``norm_f`` and ``lm_head`` on the rank of the last). The optimizer,
  gradient clipping and checkpoints use it: a checkpoint written under one layout loads under
  any other.
* ``plan.stages`` -- the modules the train step runs (:class:`NemotronHStage`, one per pipeline
  stage held by this rank; one covering the whole model without PP). A stage runs
  embeddings (first stage) -> its blocks -> ``norm_f`` + LM head + the cross-entropy *sum*
  (last stage), so the LM head is used inside a module call, where FSDP has gathered it.
* what the trainer's ``TrainStep`` needs (models/ does not import training/; the recipe builds
  the step): ``plan.loss_fn(model, batch)`` (the CE sum through the single stage) and
  ``plan.grad_sync_module`` (the FSDP root whose gradient reduction runs once per step, or
  None) without PP; ``plan.pipeline`` (a ``PipelineTrainStep``, running the schedule) under PP.
* ``plan.clip_grad_norm`` -- gradient norm/clipping over every mesh and pipeline stage.
* ``plan.dp_rank`` / ``plan.dp_size`` / ``plan.dp_group`` -- the data-parallel coordinates the
  data loader and the loss/label-count reductions use.

FSDP2 units: the embeddings, every block (an MoE block's experts are their own unit on the
expert mesh when ``ep > 1``), and each stage module as root (holding ``norm_f`` + ``lm_head``).
Gradients are summed (never averaged) over data-parallel ranks; the trainer divides by the
global label-token count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from hybridtrain.distributed.expert_parallel import apply_expert_parallel, check_ep_backend
from hybridtrain.distributed.fsdp import (
    mixed_precision_policy,
    resolve_reshard_after_forward,
    shard_module,
    sum_gradients,
)
from hybridtrain.distributed.parallel_dims import ParallelDims
from hybridtrain.distributed.pipeline import (
    PipelineTrainStep,
    balanced_split,
    resolve_schedule,
    split_from_points,
    stage_ids_for_rank,
)
from hybridtrain.distributed.utils import clip_grad_norm_

from .model import NemotronHForCausalLM

logger = logging.getLogger(__name__)

__all__ = ["NemotronHStage", "stage_loss_fn", "ParallelPlan", "layer_costs", "parallelize_nemotron_h"]

IGNORE_INDEX = -100
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def full_logits_ce_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference CE sum (full logits, fp32); the recipe passes the chunked one."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


# -- the stage module -----------------------------------------------------------------------------
class NemotronHStage(nn.Module):
    """A contiguous slice of a Nemotron-H model (the whole model when it is the only stage).

    ``forward(x, position_ids=None, cu_seqlens=None, labels=None)``: ``x`` is ``input_ids`` on the
    first stage and hidden states ``[B, L, H]`` on the others; the last stage returns the fp32
    sum of token cross-entropies over ``labels`` (already shifted, ``-100`` ignored), the others
    their hidden states. Holds references to the model's own modules: no parameter is copied.
    """

    def __init__(self, model: NemotronHForCausalLM, layer_ids: Sequence[int], is_first: bool,
                 is_last: bool, loss_fn: LossFn | None = None):
        super().__init__()
        bb = model.backbone
        self.is_first, self.is_last = is_first, is_last
        self.embeddings = bb.embeddings if is_first else None
        self.layers = nn.ModuleDict({str(i): bb.layers[str(i)] for i in layer_ids})
        self.norm_f = bb.norm_f if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.loss_fn = loss_fn or full_logits_ce_sum
        # a bound method, not a submodule: the model's packing logic (seq_idx, attention mask)
        self._sequence_info = model.sequence_info
        self.hidden_dtype: torch.dtype | None = None  # set under pipeline parallelism

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embeddings(x) if self.is_first else x
        B, L = h.shape[:2]
        info = self._sequence_info(B, L, h.device, position_ids=position_ids, cu_seqlens=cu_seqlens)
        for block in self.layers.values():
            h = block(h, info)
        if not self.is_last:
            if self.hidden_dtype is not None and h.dtype != self.hidden_dtype:
                raise RuntimeError(
                    f"pipeline stage output is {h.dtype}, but the stages exchange "
                    f"{self.hidden_dtype} activations; keep the residual stream in the "
                    "parameter dtype"
                )
            return h
        h = self.norm_f(h)
        if labels is None:
            return self.lm_head(h).float()
        return self.loss_fn(h, self.lm_head.weight, labels)


MODEL_INPUT_KEYS = ("position_ids", "cu_seqlens")


def stage_loss_fn(stage: NemotronHStage) -> Callable[[nn.Module, dict], torch.Tensor]:
    """``loss_fn(model, batch)`` -> the CE sum of ``batch`` through ``stage`` (a stage covering
    the whole model; ``model`` is not used): the loss function of the trainer's ``TrainStep``."""
    assert stage.is_first and stage.is_last

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        kwargs = {k: batch[k] for k in MODEL_INPUT_KEYS if batch.get(k) is not None}
        return stage(batch["input_ids"], labels=batch["labels"], **kwargs)

    return loss_fn


# -- the plan -------------------------------------------------------------------------------------
@dataclass
class ParallelPlan:
    model: nn.Module
    stages: list[nn.Module]
    dims: ParallelDims
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None
    grad_sync_module: nn.Module | None = None
    pipeline: PipelineTrainStep | None = None
    stage_ids: list[int] = field(default_factory=lambda: [0])
    layer_ranges: list[tuple[int, int]] = field(default_factory=list)
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    pp_group: Any = None

    def clip_grad_norm(self, parameters, max_norm: float | None, norm_type: float = 2.0):
        """Global gradient norm (all meshes, all pipeline stages); clips when ``max_norm``."""
        return clip_grad_norm_(parameters, max_norm, norm_type, pp_group=self.pp_group)


def layer_costs(config, seq_len: int = 4096) -> list[float]:
    """Relative forward cost of each layer for the pipeline split, per token: 2 × active
    parameters (for MoE: router + shared expert + top-k experts) plus attention's quadratic term
    at ``seq_len``. (``hybridtrain.training.flops`` gives exact FLOPs; the recipe may pass them.)"""
    H = config.hidden_size
    out = []
    for t in config.layers_block_type:
        if t == "linear_attention":
            d_in = config.mamba_num_heads * config.mamba_head_dim
            gn = config.n_groups * config.ssm_state_size
            params = H * (2 * d_in + 2 * gn + config.mamba_num_heads) + d_in * H
            scan = config.chunk_size * (gn + d_in) + 4 * d_in * config.ssm_state_size
            out.append(2.0 * params + 2.0 * scan)
        elif t == "full_attention":
            a, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
            params = H * (a + 2 * kv) * d + a * d * H
            out.append(2.0 * params + 2.0 * a * d * seq_len)
        elif t == "mlp":
            out.append(2.0 * 2 * H * config.intermediate_size)
        elif t == "moe":
            d_e = config.moe_latent_size or H
            params = (H * config.n_routed_experts
                      + config.num_experts_per_tok * 2 * d_e * config.moe_intermediate_size
                      + 2 * H * config.moe_shared_expert_intermediate_size)
            if config.moe_latent_size:
                params += 2 * H * d_e
            out.append(2.0 * params)
        else:  # pragma: no cover - config validates layer types
            raise AssertionError(t)
    return out


def _pipeline_layout(config, dims: ParallelDims, schedule: str, stages_per_rank: int | None,
                     split_points, costs):
    spec = resolve_schedule(schedule)
    if stages_per_rank is None:
        stages_per_rank = 2 if spec.multi else 1
    if spec.multi and stages_per_rank < 2:
        raise ValueError(
            f"distributed.pp_schedule={spec.name!r} interleaves several stages per rank; set "
            f"pp_stages_per_rank >= 2 (got {stages_per_rank})"
        )
    if not spec.multi and stages_per_rank != 1:
        raise ValueError(
            f"distributed.pp_schedule={spec.name!r} runs one stage per rank; use an interleaved "
            f"schedule (interleaved1f1b, loopedbfs, interleavedzb, zbv) for "
            f"pp_stages_per_rank={stages_per_rank}"
        )
    if spec.style == "v" and stages_per_rank != 2:
        raise ValueError(f"distributed.pp_schedule={spec.name!r} needs pp_stages_per_rank=2")
    num_stages = dims.pp * stages_per_rank
    n = config.num_hidden_layers
    if split_points:
        ranges = split_from_points(split_points, n, num_stages)
    else:
        costs = list(costs) if costs is not None else layer_costs(config)
        if len(costs) != n:
            raise ValueError(f"pipeline: {len(costs)} layer costs given for {n} layers")
        head = 2.0 * config.hidden_size * config.vocab_size
        ranges = balanced_split(costs, num_stages, first_extra=0.0, last_extra=head)
    stage_ids = stage_ids_for_rank(dims.local_rank("pp"), dims.pp, stages_per_rank, spec.style)
    return spec, num_stages, ranges, stage_ids


def _prune(model: NemotronHForCausalLM, keep_layers: set[int], first: bool, last: bool) -> None:
    bb = model.backbone
    for key in list(bb.layers.keys()):
        if int(key) not in keep_layers:
            del bb.layers[key]
    if not first:
        bb.embeddings = None
    if not last:
        bb.norm_f = None
        model.lm_head = None


def parallelize_nemotron_h(
    model: NemotronHForCausalLM,
    dims: ParallelDims,
    *,
    device: torch.device | str = "cpu",
    loss_fn: LossFn | None = None,
    activation_checkpointing: Any = None,
    compile: bool = False,
    param_dtype: Any = "auto",
    reduce_dtype: Any = torch.float32,
    reshard_after_forward: Any = "default",
    cpu_offload: bool = False,
    ep_backend: str = "alltoall",
    pp_schedule: str = "1f1b",
    pp_stages_per_rank: int | None = None,
    pp_microbatch_size: int | None = None,
    pp_split_points: Sequence[Any] | None = None,
    pp_layer_costs: Sequence[float] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> ParallelPlan:
    """Apply the layout of ``dims`` to ``model`` (in place) and return the :class:`ParallelPlan`.

    ``param_dtype`` / ``reduce_dtype``: FSDP2's mixed-precision policy (``auto``: the training
    compute dtype ``autocast_dtype``, i.e. bf16 all-gathers and compute in bf16 runs; gradients
    are reduced in ``reduce_dtype``, fp32 by default; master weights and optimizer state stay in
    the parameters' own dtype).

    Every rank must call it with an identically initialised model. With a single process and
    all degrees 1 it only wraps the model in one stage (and applies activation checkpointing /
    compile when asked), so the same code path runs everywhere.
    """
    device = torch.device(device)
    config = model.config
    if param_dtype in ("auto", None):
        # FSDP gathers and computes in the training dtype (bf16 runs: bf16 all-gathers, fp32
        # masters and fp32 gradient reduction); an explicit float32 keeps fp32 all-gathers
        param_dtype = autocast_dtype
    if dims.tp > 1:
        raise ValueError(
            f"distributed.tp={dims.tp}: tensor parallelism is not implemented for Nemotron-H yet; "
            "use tp: 1 (FSDP2, pipeline and expert parallelism cover the supported layouts)"
        )
    if dims.cp > 1:
        raise ValueError(
            f"distributed.cp={dims.cp}: context parallelism is not implemented for Nemotron-H yet; "
            "use cp: 1"
        )
    distributed = dims.world_size > 1
    if distributed:
        assert dims._meshes, "ParallelDims.build_mesh() must run before parallelize"

    # 1. pipeline split: this rank keeps only its stages' layers
    if dims.pp > 1:
        spec, num_stages, ranges, stage_ids = _pipeline_layout(
            config, dims, pp_schedule, pp_stages_per_rank, pp_split_points, pp_layer_costs)
        if spec.split_backward and loss_fn is not None:
            # zero-bubble schedules back-propagate twice through the loss (inputs, then weights)
            import functools
            import inspect

            if "recompute" in inspect.signature(loss_fn).parameters:
                loss_fn = functools.partial(loss_fn, recompute=True)
        keep = {i for s in stage_ids for i in range(*ranges[s])}
        _prune(model, keep, first=0 in stage_ids, last=num_stages - 1 in stage_ids)
        logger.info("pipeline: %d stages, layer ranges %s; this rank runs stages %s (%s)",
                    num_stages, ranges, stage_ids, spec.name)
    else:
        num_stages, ranges, stage_ids = 1, [(0, config.num_hidden_layers)], [0]

    blocks = list(model.backbone.layers.items())

    # 2. expert parallelism
    if dims.ep > 1:
        check_ep_backend(ep_backend, device.type)
        dims.check_experts(config.n_routed_experts)
        for _, block in blocks:
            if block.block_type == "moe":
                apply_expert_parallel(block.mixer, dims.mesh("ep"))

    # 3. activation checkpointing (every-k-th counts global layer indices)
    if activation_checkpointing:
        chosen = apply_activation_checkpointing(model.backbone.layers, activation_checkpointing)
        logger.info("activation checkpointing on layers %s", chosen)
        blocks = list(model.backbone.layers.items())  # the wrapped blocks: compile and shard those

    # 4. compile each block (in place: parameter names unchanged)
    if compile:
        for _, block in blocks:
            block.compile()

    stages = [
        NemotronHStage(model, range(*ranges[s]), is_first=s == 0, is_last=s == num_stages - 1,
                       loss_fn=loss_fn)
        for s in stage_ids
    ]

    # 5. FSDP2 / HSDP
    if dims.fsdp_enabled:
        mp = mixed_precision_policy(param_dtype, reduce_dtype)
        rf = resolve_reshard_after_forward(reshard_after_forward, dims.pp_enabled)
        mesh = dims.dense_fsdp_mesh()
        if model.backbone.embeddings is not None:
            shard_module(model.backbone.embeddings, mesh, mp, rf, cpu_offload=cpu_offload)
        for idx, (_, block) in enumerate(blocks):
            if dims.ep > 1 and block.block_type == "moe":
                experts = block.mixer.experts
                e_local = config.n_routed_experts // dims.ep
                placement = None
                if e_local % dims.efsdp:  # too few local experts to shard dim 0 evenly
                    from torch.distributed.tensor import Shard

                    placement = lambda p: Shard(1)  # noqa: E731
                shard_module(experts, dims.expert_fsdp_mesh(), mp, rf, placement,
                             cpu_offload=cpu_offload)
            # the last block's parameters are needed again at once by backward
            shard_module(block, mesh, mp, rf and idx < len(blocks) - 1, cpu_offload=cpu_offload)
        for stage in stages:  # roots: norm_f + lm_head of the last stage, and the schedule hooks
            shard_module(stage, mesh, mp, reshard_after_forward=False, cpu_offload=cpu_offload)
            sum_gradients(stage)
        sum_gradients(model)

    pp_group = dims.group("pp") if dims.pp > 1 else None
    if dims.pp > 1:
        hidden_dtype = mixed_precision_policy(param_dtype, reduce_dtype).param_dtype
        if hidden_dtype is None or not dims.fsdp_enabled:
            hidden_dtype = next(model.parameters()).dtype
        for stage in stages:
            stage.hidden_dtype = hidden_dtype
        pipeline = PipelineTrainStep(
            stages, stage_ids, num_stages, pp_group, device, hidden_size=config.hidden_size,
            hidden_dtype=hidden_dtype, schedule=pp_schedule, microbatch_size=pp_microbatch_size)
        step_parts = dict(pipeline=pipeline)
    else:
        step_parts = dict(loss_fn=stage_loss_fn(stages[0]),
                          grad_sync_module=stages[0] if dims.fsdp_enabled else None)

    dp_rank, dp_size, dp_group = 0, 1, None
    if distributed:
        dp_rank, dp_size, dp_group = dims.local_rank("dp"), dims.dp, dims.group("dp")
    return ParallelPlan(model=model, stages=stages, dims=dims, **step_parts,
                        stage_ids=stage_ids, layer_ranges=ranges, dp_rank=dp_rank,
                        dp_size=dp_size, dp_group=dp_group, pp_group=pp_group)
