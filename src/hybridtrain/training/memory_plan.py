"""The memory each rank of a recipe's layout needs, estimated before the run (what ``hybridtrain
plan``, :mod:`hybridtrain.recipes.plan`, prints and advises on).

The model is built on the meta device from the recipe's model section (a class with its config,
or ``from_pretrained``: only the checkpoint's ``config.json`` is read, never its weights), LoRA
applied as the recipe says, and split and sharded *arithmetically* the way the run lays it out
(:mod:`hybridtrain.distributed.parallel_plan`): pipeline stages (``pipeline_layout``), expert parameters
(the spec's ``expert_modules``) sliced over ``ep`` then FSDP-sharded over ``efsdp``, every other
parameter FSDP-sharded over ``dp_shard·cp`` (dim 0, ``torch.chunk`` sizes) and replicated over
``dp_replicate``. Per rank:

* **parameters / gradients / optimizer state**: local bytes of the rank's shards in their dtypes
  (gradients of trainable parameters only; AdamW: two moments in the parameter's dtype and a
  4-byte step per tensor). These match a real run's tensors (tests: within 10 %).
* **activations**: the model's estimate per micro-batch (``MemoryPlanSupport.activation_bytes``)
  by layer type, with activation checkpointing applied per block, plus on the first stage its
  input encoders' (``encoder_activation_bytes``, e.g. a vision encoder) and on the last the
  loss's, times the micro-batches the run's pipeline schedule keeps in flight on that rank
  (read from the order of the schedule the run builds); plus the largest working set of one
  block's backward (with its recompute under checkpointing and, with an NF4 base, the working
  set of dequantising its largest weight: made and dropped inside the block) or of the loss
  ("backward"). An estimate (docs/memory.md: how it compares with measured peaks).
* **buffers**: FSDP's all-gathered parameters (the whole stage when it does not reshard after
  forward, as under pipeline parallelism by default, where torch's ``PipelineStage`` also keeps
  each unit gathered after its backward; else two units) and unsharded gradients (one unit's;
  under pipeline parallelism the stage's, accumulated in the reduce dtype until the last
  micro-batch's backward reduce-scatters them: what they exceed the sharded gradients by);
  without FSDP, autocast's low-precision weight copies. Under pipeline parallelism also the
  step's inputs (every micro-batch's, merged on every rank) and the buffers torch's
  ``PipelineStage`` receives activations and gradients into (one per micro-batch). Under pipeline
  parallelism the plan also gives the peak under the other ``fsdp_reshard_after_forward``
  policy (``MemoryPlan.reshard_peaks``).

* **CPU GEMM kernels** (``cpu_gemm_kernels``, CPU bf16/fp16 runs where this machine's GEMMs in
  that dtype are oneDNN's, ``ops.backend.cpu_gemm_kernels_cached``: bf16 with AVX-512 or AMX):
  the GEMM kernels oneDNN builds and caches per shape, at most the cache bound in effect
  (``hybridtrain.config.dist_env.gemm_kernel_cache_entries``: 128 unless the environment says
  otherwise) at ``GEMM_KERNEL_BYTES`` (1 MiB) each. fp32 CPU GEMMs are MKL's and bf16 ones on a
  CPU without AVX-512 torch's own loops: no such cache.

Under ``distributed.encoder_ranks: E`` (an encoder on its own ranks, the spec's
``HeteroSupport.sides`` split): ranks ``0..E-1`` hold the encoder FSDP2-sharded over them and
the activations of every micro-batch they serve in a step (all sent before any gradient comes
back), the other ranks the rest of the model, planned as above over their own degrees.

With ``distributed.cpu_offload`` the parameters, gradients and optimizer state are counted on the
host (``RankMemory.host``), not in the device total.

The headroom rule (:data:`HEADROOM`): the peak may take at most 90 % of the device, the rest
being for what the plan does not count (the CUDA context, the allocator's fragmentation, NCCL's
buffers). For a CPU run glibc's heap (freed blocks it keeps) is not counted either, nor Intel
MKL's own memory in fp32 GEMMs (packing buffers and the pool that keeps them: by the CPU's vendor,
its ISA and each GEMM's shape, none on an AMD EPYC; docs/memory.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from hybridtrain.config import resolve_target
from hybridtrain.config.dist_env import GEMM_KERNEL_BYTES, gemm_kernel_cache_entries
from hybridtrain.config.sections import recipe_config
from hybridtrain.distributed.activation_checkpoint import parse_ac_policy
from hybridtrain.fileio import read_json
from hybridtrain.distributed.fsdp import (
    fsdp_param_dtype, resolve_dtype, resolve_reshard_after_forward,
)
from hybridtrain.distributed.pipeline_layout import (
    micro_batches_in_flight, pipeline_layout, stage_ids_for_rank,
)
from hybridtrain.distributed.parallel_plan import pipeline_split_seq_len, recipe_seq_len
from hybridtrain.distributed.hetero import receiver_degrees, sender_degrees
from hybridtrain.distributed.tensor_parallel import tp_shard_dims
from hybridtrain.models.spec import (ActivationBytes, HeteroSupport, LayerTypes, MemoryPlanSupport,
                                     model_spec_for)
from hybridtrain.ops.backend import cpu_gemm_kernels_cached
from hybridtrain.peft.lora import apply_lora, expert_types, quantize_base
from hybridtrain.peft.quant import is_nf4, nf4_bytes
from hybridtrain.training.builder import build_on_meta
from hybridtrain.training.precision import autocast_dtype, parse_dtype
from hybridtrain.training.validate import validate_run


__all__ = ["HEADROOM", "RankMemory", "MemoryPlan", "meta_model", "plan_memory"]

GiB = 1024 ** 3


# the headroom rule: a plan may take this fraction of the device memory; the rest is for what it
# does not count (CUDA context, allocator fragmentation, NCCL buffers: a few GiB on an 80 GB GPU)
HEADROOM = 0.90


# AdamW's per-parameter state: exp_avg and exp_avg_sq (parameter dtype), step (fp32 scalar)
_ADAM_MOMENTS, _STEP_BYTES = 2, 4


@dataclass
class RankMemory:
    """Bytes one rank holds (see the module docstring)."""

    rank: int
    stages: list[int]
    params: float
    grads: float
    optimizer: float
    activations_per_micro_batch: dict[str, float]
    micro_batches_in_flight: float
    activations: float
    buffers: dict[str, float]
    offloaded: bool = False  # FSDP CPU offload: parameters, gradients, optimizer on the host
    role: str | None = None  # under distributed.encoder_ranks: "encoder" or "language model"

    @property
    def host(self) -> float:
        """Bytes the rank keeps in host memory instead (CPU offload)."""
        return self.params + self.grads + self.optimizer if self.offloaded else 0.0

    @property
    def total(self) -> float:
        """Device bytes."""
        return self.params + self.grads + self.optimizer - self.host + self.activations + sum(
            self.buffers.values())


@dataclass
class MemoryPlan:
    source: str
    world_size: int
    degrees: dict[str, int]
    model: str
    num_params: int
    num_trainable: int
    param_dtypes: list[str]
    compute_dtype: str
    micro_batch: int
    seq_len: int
    activation_checkpointing: Any
    ranks: list[RankMemory]
    device_memory: float | None = None
    advice: list[dict] = field(default_factory=list)
    # under pp with FSDP: {distributed.fsdp_reshard_after_forward: peak} for the recipe's policy
    # and the other one (default: units stay gathered through the step; always: they reshard)
    reshard_peaks: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what the figures leave out

    @property
    def peak(self) -> float:
        return max(r.total for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        """The peak is at most the device memory (None: no device memory given)."""
        return None if self.device_memory is None else self.peak <= self.device_memory

    @property
    def limit(self) -> float | None:
        """What the headroom rule lets the plan take: :data:`HEADROOM` of the device memory."""
        return None if self.device_memory is None else HEADROOM * self.device_memory

    @property
    def within_headroom(self) -> bool | None:
        """The peak is within the headroom rule (None: no device memory given)."""
        return None if self.device_memory is None else self.peak <= self.limit

    def roles(self) -> list[list[RankMemory]]:
        """Ranks grouped by identical figures (e.g. one group per pipeline stage)."""
        groups: dict[tuple, list[RankMemory]] = {}
        for r in self.ranks:
            key = (r.role, tuple(r.stages), round(r.params), round(r.grads), round(r.optimizer),
                   round(r.activations), round(sum(r.buffers.values())))
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    def to_dict(self) -> dict:
        d = asdict(self)
        for r, rd in zip(self.ranks, d["ranks"]):
            rd.update(total=r.total, host=r.host)
        d.update(peak=self.peak, fits=self.fits, headroom=HEADROOM, limit=self.limit,
                 within_headroom=self.within_headroom)
        return d


# -- the model on the meta device ----------------------------------------------------------------
def _checkpoint_dtype(hf_config: dict) -> torch.dtype:
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return parse_dtype(name, "config.json torch_dtype") if name else torch.float32


def meta_model(model_node) -> tuple[Any, nn.Module]:
    """(spec, model on the meta device) of a recipe's model section, without reading weights:
    a model class (its ``config`` instantiated) or a ``Model.from_pretrained(dir, dtype=...)``
    (the config from ``dir/config.json``; the parameters in ``dtype``, else the checkpoint's)."""
    target = resolve_target(model_node["_target_"], model_node.target_prefixes())
    owner = getattr(target, "__self__", None)
    if not (isinstance(owner, type) and issubclass(owner, nn.Module)):
        return _meta_model_of_target(model_node)
    spec = model_spec_for(owner)
    # from_pretrained(local_dir, dtype=None, device=None): the model contract (models/spec.py)
    bound = {k: v for k, v in model_node.to_dict().items() if not k.startswith("_")}
    bound.update(zip(("local_dir", "dtype", "device"), model_node.get("_args_") or ()))
    local_dir = bound.get("local_dir")
    if local_dir is None:
        raise ValueError(f"{model_node.where()}: {model_node['_target_']} needs local_dir (the "
                         "checkpoint folder)")
    path = os.path.join(str(local_dir), "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_node.where()}: {path} does not exist; the plan reads the "
                         "checkpoint's config.json (set the model directory, e.g. its env var)")
    hf = read_json(path)
    config = spec.config_cls.from_dict(hf, source=path)
    with torch.device("meta"):
        model = spec.model_cls(config)
    dtype = bound.get("dtype")
    model.to(parse_dtype(dtype, f"{model_node.dotted_path()}.dtype") if dtype
             else _checkpoint_dtype(hf))
    return spec, model


def _meta_model_of_target(model_node) -> tuple[Any, nn.Module]:
    """(spec, model) of a model class or factory, built on the meta device as the run builds it
    (:func:`~hybridtrain.training.builder.build_on_meta`)."""
    model = build_on_meta(model_node)
    if not isinstance(model, nn.Module) or not all(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"{model_node.where('_target_')}: hybridtrain plan builds the model on the meta device "
            f"from a model class with a config, Model.from_pretrained or a factory that builds on "
            f"the meta device; {model_node['_target_']} is none of them")
    return model_spec_for(model), model


# -- sharding arithmetic -------------------------------------------------------------------------
def _chunk(n: int, parts: int, i: int) -> int:
    """Rows of part ``i`` when ``torch.chunk`` splits ``n`` rows in ``parts`` (FSDP2's shards)."""
    size = -(-n // parts)
    return max(0, min(size, n - i * size))


def _coords(rank: int, dims) -> dict[str, int]:
    """A rank's coordinates in the layout ``pp x dp_replicate x dp_shard x cp x tp``."""
    out = {}
    for name in ("tp", "cp", "dp_shard", "dp_replicate", "pp"):
        size = getattr(dims, name)
        out[name], rank = rank % size, rank // size
    out["dp_shard_cp"] = out["dp_shard"] * dims.cp + out["cp"]
    out["efsdp"], out["ep"] = divmod(out["dp_shard_cp"], dims.ep)
    return out


def _local_numel(shape: tuple[int, ...], expert: bool, dims, c: dict[str, int], tp_dim: int | None = None) -> int:
    """Elements of a parameter of ``shape`` on the rank at coordinates ``c``; ``tp_dim``: the dim
    tensor parallelism shards it along (None: replicated over tp). FSDP2 then shards the tp
    shard's dim 0."""
    shape = list(shape)
    if not shape:
        return 1
    if tp_dim is not None:
        shape[tp_dim] = _chunk(shape[tp_dim], dims.tp, c["tp"])
    if expert and dims.ep > 1:
        shape[0] //= dims.ep
        if dims.fsdp_enabled:
            d = 1 if shape[0] % dims.efsdp else 0  # as apply_fsdp: Shard(1) for too few experts
            shape[d] = _chunk(shape[d], dims.efsdp, c["efsdp"])
    elif dims.fsdp_enabled:
        shape[0] = _chunk(shape[0], dims.dp_shard_cp, c["dp_shard_cp"])
    return math.prod(shape)


def _expert_params(model: nn.Module) -> set[int]:
    types = expert_types(model)
    return {id(p) for m in model.modules() if isinstance(m, types)
            for p in m.parameters(recurse=False)}


def _unique(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(dict((id(p), (n, p)) for n, p in module.named_parameters()).values())


# -- the plan ------------------------------------------------------------------------------------
def _compute_dtype(training, device_type: str) -> torch.dtype:
    if str(training.dtype).lower() == "auto":  # the GPU a plan is for: bf16 (CPU: fp32)
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return parse_dtype(training.dtype, "training.dtype")


def _pipeline_parts(spec, model: nn.Module, dims, distributed, seq_len: int):
    """(schedule or None, stages per rank, [(stage ids, layer positions, holds the last
    stage, the rank's part of the model)] per pp rank), as :func:`~hybridtrain.distributed.
    plan.parallelize` splits it."""
    names = spec.pipeline.layers(model)
    if dims.pp == 1:
        return None, 1, [([0], list(range(len(names))), True, model)]
    config = model.config
    sched, num_stages, ranges, _ = pipeline_layout(
        len(names), dims, distributed, spec.flops.layer(config, seq_len), spec.flops.head(config))
    per_rank = num_stages // dims.pp
    parts = []
    for r in range(dims.pp):
        ids = stage_ids_for_rank(r, dims.pp, per_rank, sched.style)
        mine = [i for s in ids for i in range(*ranges[s])]
        last = num_stages - 1 in ids
        parts.append((ids, mine, last, spec.pipeline.stage(
            model, [names[i] for i in mine], 0 in ids, last)))
    return sched, per_rank, parts


def _tp_dims(spec, model: nn.Module, dims) -> dict[int, int]:
    """{id(parameter): the dim tensor parallelism shards it along}, from the spec's ``tp_plan``
    (the rules its parallelize function applies); parameters not in it are replicated over tp."""
    if dims.tp == 1:
        return {}
    tp_plan = _memory_part(spec).tp_plan
    if tp_plan is None:
        raise ValueError(f"distributed.tp={dims.tp}: the model spec {spec.name!r} has no tensor-parallel "
                         "plan; use tp: 1")
    return {id(model.get_parameter(name)): dim
            for name, dim in tp_shard_dims(model, tp_plan(model, dims.tp)).items()}


def _memory_part(spec):
    """The spec's MemoryPlanSupport (an empty one: no activation estimate, no TP plan)."""
    return spec.find(MemoryPlanSupport) or MemoryPlanSupport()


def _states(part: nn.Module, experts: set[int], dims, c: dict[str, int], tp_dims: dict[int, int]):
    """(parameter, gradient, AdamW state) bytes of ``part`` on the rank at coordinates ``c``."""
    params = grads = opt = 0.0
    for _, p in _unique(part):
        b = _bytes(p, _local_numel(tuple(p.shape), id(p) in experts, dims, c, tp_dims.get(id(p))))
        params += b
        if p.requires_grad:
            grads += b
            opt += _ADAM_MOMENTS * b + _STEP_BYTES
    return params, grads, opt


def _bytes(p: torch.Tensor, numel: int, elsize: int | None = None) -> float:
    """Bytes ``numel`` elements of parameter ``p`` hold: an NF4 base weight's 4-bit codes and
    scales (QLoRA), else ``elsize`` (default the parameter's) each."""
    if is_nf4(p):
        return nf4_bytes(numel, getattr(p, "_local_tensor", p).scaler_block_size)
    return float(numel * (elsize or p.element_size()))


def _nf4_dequantised(part: nn.Module, experts: set[int],
                     skip: frozenset[int] = frozenset()) -> float:
    """An NF4 base's compute copy: each weight of ``part`` (but those whose ids are in ``skip``)
    is dequantised where it is used (one expert of a stacked tensor at a time) and dropped after;
    the largest such working set, in forward or backward: torchao's ``get_original_weight``
    holds both 4-bit halves of the codes as int64 (8 bytes per weight), their code values, the
    scaled values and the interleaved result (3 x the weight's dtype; glibc's peak of a 1M-weight
    one, 2026-12-06, torchao 0.18: 14 bytes per weight in bf16, 20 in fp32)."""
    sizes = [p.numel() // (_stacked_experts(part, p) if id(p) in experts else 1)
             * (8 + 3 * p.element_size())
             for _, p in _unique(part) if is_nf4(p) and id(p) not in skip]
    return float(max(sizes, default=0))


@dataclass(frozen=True)
class _Dequantising:
    """Where an NF4 base is dequantised: ``layers``, the working set of each block (by position)
    while its forward or backward runs; ``rest``, that of the weights outside the blocks (an
    encoder, the head), while they run. It adds to that block's working set, never to another
    one's: the copy is made and dropped inside one layer's call."""

    layers: tuple[float, ...]
    rest: float

    @classmethod
    def of(cls, model: nn.Module, names: list[str], experts: set[int]) -> "_Dequantising":
        # the blocks sit in an nn.ModuleDict keyed by the names PipelineSplit.layers gives
        holder = next((m for m in model.modules()
                       if isinstance(m, nn.ModuleDict) and list(m.keys()) == names), None)
        if holder is None:  # not found: every block may dequantise the largest weight
            whole = _nf4_dequantised(model, experts)
            return cls((whole,) * len(names), whole)
        inside = frozenset(id(p) for p in holder.parameters())
        return cls(tuple(_nf4_dequantised(holder[n], experts) for n in names),
                   _nf4_dequantised(model, experts, skip=inside))


def _stacked_experts(part: nn.Module, p: torch.Tensor) -> int:
    return next(m.num_experts for m in part.modules() if any(q is p for q in m.parameters(recurse=False)))


def _layer_activations(act: ActivationBytes, policy, names: list[str], positions: list[int],
                       tp: int, dequantise: tuple[float, ...]):
    """({category: bytes one micro-batch keeps}, [what the micro-batch keeps up to each block
    plus that block's backward working set: its ``backward`` bytes, checkpointed its
    recomputed activations, and ``dequantise[i]``, the dequantised NF4 weight it works with]):
    the backward runs the blocks last to first, each freeing what it kept, so a block's working
    set adds to what the blocks before it keep only."""
    per_mb: dict[str, float] = {}
    kept, peaks = 0.0, []
    for i in positions:
        layer = act.layers[i]
        ckpt = policy.selects(int(names[i]), layer.type)
        keeps = layer.checkpointed if ckpt else layer.saved
        per_mb[layer.category] = per_mb.get(layer.category, 0.0) + keeps / tp
        kept += keeps / tp
        peaks.append(kept + (layer.saved * ckpt + layer.backward) / tp + dequantise[i])
    return per_mb, peaks


def _pipeline_buffers(act: ActivationBytes | None, stage_ids: list[int], num_stages: int, n_mb: int,
                      batch: float, row_inputs: float = 0.0) -> dict[str, float]:
    """What a pipeline step holds besides the layers: {"batch": the step's token ids, labels and
    positions, every micro-batch's, merged on every rank (``batch``: one micro-batch's; the
    micro-batches as loaded exist before the step and are not counted), "row_inputs": the copy
    of the encoders' inputs laid out by row for the schedule (the spec's
    ``PipelineSplit.row_inputs``; ``row_inputs``: one micro-batch's), "receive": the buffers
    torch's ``PipelineStage`` receives into, one per micro-batch of the step and kept from the
    first step on (the input on every stage but the first, the output's gradient on every stage
    but the last; the input's gradient is sent and dropped by each backward, torch's
    ``stage_backward``), "outputs": the stage outputs one micro-batch keeps for their
    backward}. A stage sends and receives one block's input (the estimate's ``checkpointed``
    bytes of a block)."""
    inputs = {"batch": n_mb * batch, "row_inputs": n_mb * row_inputs}
    if act is None or not act.layers:
        return inputs
    hidden = act.layers[0].checkpointed
    not_first = sum(s != 0 for s in stage_ids)
    not_last = sum(s != num_stages - 1 for s in stage_ids)
    return {**inputs, "receive": n_mb * hidden * (not_first + not_last),
            "outputs": hidden * not_last}


def plan_memory(cfg: Any, world_size: int, device_type: str = "cuda",
                device_memory: float | None = None) -> MemoryPlan:
    """The per-rank memory plan of recipe ``cfg`` (a path, dict or loaded config) on
    ``world_size`` ranks of ``device_type`` (its ``auto`` dtype)."""
    cfg = recipe_config(cfg)
    t, d = cfg.training, cfg.distributed
    if cfg.model is None:
        raise ValueError(f"the recipe has no model section ({cfg.source_file})")
    spec, model = meta_model(cfg.model)
    peft = cfg.peft.to_dict() if cfg.peft is not None else {}
    if cfg.peft is not None:
        apply_lora(model, **{k: v for k, v in peft.items() if k != "base_quant"})
    dims = validate_run(cfg, world_size, spec, model, device_type)
    if dims is None:
        return _plan_hetero(cfg, spec, model, world_size, device_type, device_memory)
    if peft.get("base_quant"):  # as the builder quantises (the same layers stay unquantised)
        quantize_base(model, peft["base_quant"], shards=dims.dp_shard_cp)
    return _plan_layout(cfg, spec, model, dims, device_type, device_memory)


def _plan_layout(cfg, spec, model: nn.Module, dims, device_type: str,
                 device_memory: float | None) -> MemoryPlan:
    """The plan of ``model`` laid out over ``dims`` (validated degrees; its ranks numbered
    from 0)."""
    t, d = cfg.training, cfg.distributed
    world_size = dims.world_size
    compute = _compute_dtype(t, device_type)
    autocast = autocast_dtype(compute)
    gemm_kernels = 0.0
    if device_type == "cpu" and cpu_gemm_kernels_cached(compute):
        gemm_kernels = float(gemm_kernel_cache_entries() * GEMM_KERNEL_BYTES)
    experts = _expert_params(model)
    tp_dims = _tp_dims(spec, model, dims)
    names = spec.pipeline.layers(model)
    dequantising = _Dequantising.of(model, names, experts)
    seq_len = recipe_seq_len(cfg)
    sched, per_rank, parts = _pipeline_parts(spec, model, dims, d,
                                             pipeline_split_seq_len(cfg.packing))
    # one micro-batch's activations, per layer (a context-parallel rank holds 1/cp of the rows)
    rows = (d.pp_microbatch_size or t.micro_batch_size) if dims.pp > 1 else t.micro_batch_size
    head_trains = model.lm_head.weight.requires_grad  # the output head (CausalLM.lm_head)
    activation_bytes = _memory_part(spec).activation_bytes
    act = activation_bytes(model.config, rows, -(-seq_len // dims.cp), compute,
                           t.loss_chunk_size, head_trains) if activation_bytes else None
    encoder_bytes = _memory_part(spec).encoder_activation_bytes
    policy = parse_ac_policy(t.activation_checkpointing, spec.find(LayerTypes))
    n_mb = max(1, t.global_batch_size // (dims.dp * rows))
    # one micro-batch's part of the merged batch: token ids, labels and positions (int64); the
    # encoders' inputs are merged as the row-laid copy (row_inputs) only
    batch = rows * -(-seq_len // dims.cp) * 3 * 8
    encoder_inputs = 0.0 if encoder_bytes is None else encoder_bytes(
        model, rows, -(-seq_len // dims.cp), compute, cfg).inputs
    row_inputs = encoder_inputs if spec.pipeline.row_inputs is not None else 0.0
    flights = [] if sched is None else [
        micro_batches_in_flight(d.pp_schedule, dims.pp, r, per_rank, n_mb) for r in range(dims.pp)]
    fsdp = FsdpPolicy.of(d, autocast, compute, dims.pp_enabled)
    # under pp the peak depends on the reshard policy: plan the other one's buffers too
    other = None
    if dims.pp_enabled and dims.fsdp_enabled:
        other = "default" if fsdp.reshard else "always"
        other_peak = 0.0
    ranks = []
    for rank in range(world_size):
        c = _coords(rank, dims)
        stage_ids, positions, is_last, part = parts[c["pp"]]
        # one micro-batch: what it keeps, and its peaks (what it keeps at a point plus what
        # runs there): each block's backward, an encoder's (it runs first, so its backward
        # last), the loss (it runs after every block)
        per_mb, peaks = (_layer_activations(act, policy, names, positions, dims.tp,
                                            dequantising.layers)
                         if act is not None else ({}, []))
        if act is None:  # no estimate: the largest dequantised weight of the rank at least
            peaks.append(max([dequantising.rest] + [dequantising.layers[i] for i in positions]))
        if encoder_bytes is not None and 0 in stage_ids:  # the first stage's input encoders
            enc = encoder_bytes(part, rows, -(-seq_len // dims.cp), compute, cfg)
            enc_kept = sum(enc.kept.values())
            peaks = [p + enc_kept for p in peaks] + [enc_kept + enc.backward + dequantising.rest]
            for k, v in enc.kept.items():
                per_mb[k] = per_mb.get(k, 0.0) + v
        head = 0.0
        if act is not None and is_last:  # the loss: kept per micro-batch until its backward
            per_mb["loss"] = per_mb.get("loss", 0.0) + act.loss
            head = act.loss
            peaks.append(sum(per_mb.values()) + act.loss_backward + dequantising.rest)
        pipe = (_pipeline_buffers(act, stage_ids, per_rank * dims.pp, n_mb, batch, row_inputs)
                if sched else {})
        if pipe.get("outputs"):  # a stage's output, kept for its backward
            per_mb["stage_outputs"] = pipe["outputs"]
        kept = sum(per_mb.values())
        working = max([0.0] + [p - kept for p in peaks])
        # the micro-batches the run's schedule keeps in flight on this rank (read from its
        # order): one at its peak, the others whole; the loss's, those of the last stage
        flight = 1.0 if sched is None else flights[c["pp"]]
        head_flight = 1.0 if sched is None or not head else micro_batches_in_flight(
            d.pp_schedule, dims.pp, c["pp"], per_rank, n_mb, stage=per_rank * dims.pp - 1)
        activations = (kept - head) * flight + head * head_flight + working
        if working:
            per_mb["backward"] = working
        states = _states(part, experts, dims, c, tp_dims)
        owned = _Owned(part, spec, dims, experts, tp_dims, autocast, grads=states[1])
        extra = {f"pipeline_{k}": v for k, v in pipe.items() if k != "outputs" and v}
        if gemm_kernels:
            extra["cpu_gemm_kernels"] = gemm_kernels
        ranks.append(RankMemory(rank, stage_ids, *states, per_mb, flight, activations,
                                _rank_buffers(owned, fsdp, extra),
                                dims.fsdp_enabled and d.cpu_offload))
        if other is not None:
            r = ranks[-1]
            alt = _rank_buffers(owned, dataclasses.replace(fsdp, reshard=not fsdp.reshard), extra)
            other_peak = max(other_peak, r.total - sum(r.buffers.values()) + sum(alt.values()))
    all_params = _unique(model)
    return MemoryPlan(
        source=str(cfg.source_file), world_size=world_size, degrees=dims.degrees(),
        model=type(model).__name__, num_params=sum(p.numel() for _, p in all_params),
        num_trainable=sum(p.numel() for _, p in all_params if p.requires_grad),
        param_dtypes=sorted({str(p.dtype).removeprefix("torch.") for _, p in all_params}),
        compute_dtype=str(compute).removeprefix("torch."), micro_batch=rows, seq_len=seq_len,
        activation_checkpointing=t.activation_checkpointing, ranks=ranks,
        device_memory=device_memory,
        reshard_peaks=({} if other is None else {
            str(d.fsdp_reshard_after_forward): max(r.total for r in ranks), other: other_peak}),
        warnings=[] if act is not None else [
            f"the model spec {spec.name!r} gives no activation estimate "
            "(MemoryPlanSupport.activation_bytes): the activations of its layers and loss are "
            "not counted (shown as 0)"])


# -- an encoder on its own ranks (distributed.encoder_ranks) -------------------------------------
def _plan_hetero(cfg, spec, model: nn.Module, world_size: int, device_type: str,
                 device_memory: float | None) -> MemoryPlan:
    """The plan of ``distributed.encoder_ranks``: the spec's encoder part on ranks ``0..E-1``
    (:func:`_encoder_rank`), the rest planned as a model of its own over the other ranks'
    degrees (``receiver_degrees``), its ranks numbered after the encoder's."""
    d, t = cfg.distributed, cfg.training
    E = d.encoder_ranks
    sides = spec.part(HeteroSupport, "distributed.encoder_ranks").sides
    if sides is None:
        raise ValueError(f"distributed.encoder_ranks={E}: the model spec {spec.name!r} does not "
                         "split its encoder from the rest for hybridtrain plan "
                         "(HeteroSupport.sides); plan with encoder_ranks: 0")
    encoder, rest = sides(model)
    dims = receiver_degrees(d, E, world_size)
    plan = _plan_layout(cfg, spec, rest, dims, device_type, device_memory)
    compute = _compute_dtype(t, device_type)
    served = dims.dp / E  # lanes per encoder rank (a share of one lane when below 1)
    rows = (d.pp_microbatch_size or t.micro_batch_size) if dims.pp > 1 else t.micro_batch_size
    n_mb = max(1, t.global_batch_size // (dims.dp * rows))
    ranks = [_encoder_rank(cfg, spec, encoder, rank, sender_degrees(E), compute, n_mb * served,
                           plan.seq_len) for rank in range(E)]
    ranks += [dataclasses.replace(r, rank=E + r.rank, role="language model") for r in plan.ranks]
    params = _unique(model)
    plan = dataclasses.replace(
        plan, world_size=world_size, ranks=ranks, model=type(model).__name__,
        degrees={"encoder_ranks": E, **dims.degrees(), "world_size": world_size},
        num_params=sum(p.numel() for _, p in params),
        num_trainable=sum(p.numel() for _, p in params if p.requires_grad),
        param_dtypes=sorted({str(p.dtype).removeprefix("torch.") for _, p in params}))
    return plan


def _encoder_rank(cfg, spec, encoder: nn.Module, rank: int, dims, compute: torch.dtype,
                  micro_batches: float, seq_len: int) -> RankMemory:
    """One encoder rank: its FSDP2 shards of ``encoder`` over ``dims`` (the encoder ranks'
    data-parallel degrees), and the activations of the ``micro_batches`` (of a lane's size) it
    serves in a step, all kept until their gradients come back, plus one block's backward."""
    t = cfg.training
    autocast = autocast_dtype(compute)
    states = _states(encoder, set(), dims, _coords(rank, dims), {})
    enc_bytes = _memory_part(spec).encoder_activation_bytes
    enc = enc_bytes(encoder, t.micro_batch_size, seq_len, compute, cfg) if enc_bytes else None
    per_mb = dict(enc.kept) if enc is not None else {}
    activations = sum(per_mb.values()) * micro_batches + (enc.backward if enc else 0.0)
    if enc is not None and enc.backward:
        per_mb["backward"] = enc.backward
    fsdp = FsdpPolicy.of(cfg.distributed, autocast, compute, False)
    owned = _Owned(encoder, spec, dims, set(), {}, autocast, grads=states[1])
    return RankMemory(rank, [], *states, per_mb, micro_batches, activations,
                      _rank_buffers(owned, fsdp, {}), role="encoder")


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _units(part: nn.Module, spec) -> list[list[nn.Parameter]]:
    """The parameters of each FSDP2 unit of a (stage) model: the units the spec's
    ``fsdp_units`` gives (the run's parallelize function asks it too), in the order FSDP2
    claims them (stacked experts first, each unit's parameters not claimed before), and the
    root's rest. The order does not matter to the estimate."""
    fn = _memory_part(spec).fsdp_units
    if fn is None:
        raise ValueError(f"the model spec {spec.name!r} names no FSDP2 units "
                         "(MemoryPlanSupport.fsdp_units); plan it with dp_shard 1")
    units, expert_units = fn(part)
    claimed: set[int] = set()
    out = []
    for unit in [*expert_units, *units]:
        params = [p for m in (unit if isinstance(unit, (list, tuple)) else [unit])
                  for p in m.parameters() if id(p) not in claimed]
        out.append(list({id(p): p for p in params}.values()))
        claimed.update(id(p) for p in params)
    out.append([p for _, p in _unique(part) if id(p) not in claimed])
    return [u for u in out if u]


@dataclass(frozen=True)
class FsdpPolicy:
    """How FSDP2 gathers and reduces (the recipe's ``distributed`` section): the dtype it
    gathers parameters in (None: theirs), whether units reshard after forward, and the bytes of
    one element of the dtype it reduces gradients in."""

    gather_dtype: torch.dtype | None
    reshard: bool
    reduce_bytes: int

    @classmethod
    def of(cls, distributed, autocast: torch.dtype | None, compute: torch.dtype,
           pipeline: bool) -> "FsdpPolicy":
        """The policy of the recipe's ``distributed`` section (``pipeline``: under pp)."""
        return cls(gather_dtype=fsdp_param_dtype(distributed, autocast),
                   reshard=resolve_reshard_after_forward(distributed.fsdp_reshard_after_forward,
                                                         pipeline),
                   reduce_bytes=_elsize(resolve_dtype(distributed.fsdp_reduce_dtype,
                                                      "distributed.fsdp_reduce_dtype") or compute))


@dataclass(frozen=True)
class _Owned:
    """What one rank holds, for its buffers: its (stage) model ``part`` and the layout's facts
    about its parameters; ``grads``: its sharded gradients' bytes."""

    part: nn.Module
    spec: Any
    dims: Any
    experts: set[int]
    tp_dims: dict[int, int]
    autocast: torch.dtype | None
    grads: float


def _rank_buffers(owned: _Owned, fsdp: FsdpPolicy, extra: dict[str, float]) -> dict[str, float]:
    """A rank's transient buffers under ``fsdp`` (:func:`_buffers`) plus ``extra`` (pipeline
    buffers, CPU GEMM kernels)."""
    b = _buffers(owned.part, owned.spec, owned.dims, owned.experts, owned.tp_dims,
                 owned.autocast, fsdp)
    b.update(extra)
    if owned.dims.pp_enabled and owned.dims.fsdp_enabled:
        # the stage's unsharded gradients exist until the last micro-batch's backward reduces
        # them, the sharded ones (the gradients counted) only after: count the larger once
        b["fsdp_unsharded_grads"] = max(0.0, b["fsdp_unsharded_grads"] - owned.grads)
    return b


def _buffers(part, spec, dims, experts, tp_dims, autocast, fsdp: FsdpPolicy):
    """Transient buffers: FSDP all-gathers and unsharded gradients, or autocast weight copies
    (of rank 0's tp shards)."""
    gather_dtype, reshard, reduce_bytes = fsdp.gather_dtype, fsdp.reshard, fsdp.reduce_bytes
    def tp_numel(p):
        return p.numel() if id(p) not in tp_dims else p.numel() // p.shape[tp_dims[id(p)]] * _chunk(
            p.shape[tp_dims[id(p)]], dims.tp, 0)

    if dims.fsdp_enabled:
        # Under pipeline parallelism torch's PipelineStage runs every micro-batch's backward
        # without gradient sync and reduce-scatters once after the last one: a rank holds its
        # stage's unsharded gradients (accumulated in the reduce dtype) until then. It also
        # keeps every unit gathered after its backward, unless ``always`` makes each unit
        # reshard (distributed/fsdp.py): then only the unit computing and the one prefetched.
        stage_kept = dims.pp_enabled and not reshard
        sizes, kept, grad_sizes, accumulated, in_flight = [], [], [], 0.0, 0.0
        for unit in _units(part, spec):
            # a unit gathers its parameters over dp_shard·cp (experts: over efsdp, after ep)
            full = [(tp_numel(p) // (dims.ep if id(p) in experts else 1), p) for p in unit]
            el = [_elsize(gather_dtype) if gather_dtype is not None else p.element_size()
                  for _, p in full]
            size = sum(_bytes(p, n, e) for (n, p), e in zip(full, el))  # NF4 gathers its codes
            # an experts unit on one rank (efsdp 1) always reshards after forward (fsdp.py), but
            # under pp by default stays gathered after its backward like the others
            one_rank = dims.ep > 1 and dims.efsdp * dims.dp_replicate == 1 and id(unit[0]) in experts
            (sizes if (reshard or one_rank) and not stage_kept else kept).append(size)
            trained = [(n, e) for (n, p), e in zip(full, el) if p.requires_grad]
            grad_sizes.append(sum(n * (e + reduce_bytes) for n, e in trained))
            accumulated += sum(n * reduce_bytes for n, _ in trained)
            in_flight = max(in_flight, sum(n * e for n, e in trained if e != reduce_bytes))
        gathered = sum(kept) + sum(sorted(sizes)[-2:])
        # under pp: the stage's accumulated gradients and one unit's new low-precision ones
        grads = accumulated + in_flight if dims.pp_enabled else max(grad_sizes, default=0)
        return {"fsdp_gathered_params": float(gathered), "fsdp_unsharded_grads": float(grads)}
    if autocast is not None:
        copies = sum(tp_numel(p) for _, p in _unique(part)
                     if p.dim() >= 2 and p.dtype != autocast and not is_nf4(p))
        return {"autocast_weight_copies": float(copies * _elsize(autocast))}
    return {}
