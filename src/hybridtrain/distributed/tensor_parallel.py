"""Tensor parallelism: a model's matmuls split over the ``tp`` ranks (Megatron style, with DTensor).

A model's parallelize function names, for each module, how it is split; this module gives the
ways, all on torch's public ``torch.distributed.tensor(.parallel)`` API:

* :func:`column_parallel` (``ColwiseParallel``): the weight's output rows are sharded; the
  replicated input is used as is (its gradient is all-reduced), the output stays sharded along
  its last dim (heads, channels, groups). :func:`row_parallel` (``RowwiseParallel``): the weight's
  input columns are sharded; the sharded input gives partial outputs, all-reduced. A column-
  then row-parallel pair (attention's q/k/v -> o, an MLP's up -> down) costs one all-reduce in
  forward and one in backward.
* :func:`vocab_parallel_embedding`: embedding rows sharded over the vocabulary (each rank looks
  up the ids it holds, zeros elsewhere, all-reduced). :func:`vocab_parallel_head`: the LM head's
  rows sharded over the vocabulary; the linear cross-entropy of ``ops.loss`` reads the sharded
  weight and never forms full logits (the plain logits path all-gathers them).
* :func:`shard_parameters`: parameters a module uses directly (not through a Linear), sharded
  along one dim as ``Shard`` DTensors; the module computes with their local shards
  (``local_tensor``), so the same code runs with and without tensor parallelism.
* :class:`LocalSlice`: the part of a replicated activation this rank works on (e.g. the one kv
  head of its query heads when there are fewer kv heads than ranks), with the gradient summed over
  the ranks in backward.
* :class:`AdaptedLinearParallel`: the column / row style of a linear that carries a low-rank
  adapter (``lora_A [r, in]``, ``lora_B [out, r]``, as ``peft.lora.LoRALinear``): column-wise,
  ``lora_B`` is split with the weight's output rows and ``lora_A`` is whole on every rank;
  row-wise, ``lora_A`` is split with the weight's input columns and ``lora_B`` is whole, its
  partial sums reduced in the same all-reduce as the base's. :func:`apply_tp_plan` picks it for
  a "column" / "row" entry whose module has the adapter; the module computes with
  :func:`grads_in_own_placements` of its adapters.
* :class:`SequenceParallel` (``distributed.sequence_parallel``): the residual stream and the norms
  between the tensor-parallel layers hold each rank's part of the sequence; a model gathers the
  whole sequence before its tensor-parallel layers and takes its part of their output.

Parameters become DTensors on the ``tp`` mesh: checkpoints and exports hold full tensors, and a
checkpoint written under one layout loads under any other. FSDP2 then shards them over a 2-D
(data-parallel x tp) mesh: the ``tp`` mesh must be sliced from the same mesh view as FSDP's
(:func:`tp_mesh`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hybridtrain.distributed.utils import local_tensor

__all__ = ["tp_mesh", "column_parallel", "row_parallel", "vocab_parallel_embedding",
           "vocab_parallel_head", "apply_tensor_parallel", "shard_parameters", "LocalSlice",
           "check_divisible", "apply_tp_plan", "tp_shard_dims", "AdaptedLinearParallel",
           "grads_in_own_placements", "SequenceParallel"]


def tp_mesh(dims):
    """The tensor-parallel mesh of ``dims`` (a built ParallelDims), sliced from the FSDP view so
    that FSDP2 can combine it with its own data-parallel mesh."""
    return dims.mesh("dp_shard_cp", "tp")["tp"]


def check_divisible(what: str, n: int, tp: int, hint: str = "") -> None:
    """``ValueError`` naming ``what`` unless ``n`` splits evenly over ``tp`` ranks."""
    if n % tp:
        raise ValueError(f"distributed.tp={tp} does not divide {what} = {n}: every tensor-parallel "
                         f"rank must hold the same share{hint}; choose a tp that divides {n}")


def column_parallel():
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


def row_parallel():
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel()


def vocab_parallel_embedding():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def vocab_parallel_head():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(output_layouts=Replicate())


# A model's tensor-parallel plan: {submodule path: a style name below, or a tuple of the
# submodule's own parameter names sharded along dim 0 (:func:`shard_parameters`)}. The same plan
# splits the model (:func:`apply_tp_plan`) and tells ``hybridtrain plan`` each parameter's share
# (:func:`tp_shard_dims`).
STYLES = {"column": column_parallel, "row": row_parallel, "vocab_embedding": vocab_parallel_embedding,
          "vocab_head": vocab_parallel_head}
# A linear's parameters sharded along a dim under the column / row style (the others, e.g. a row
# bias, replicated); lora_A / lora_B: a LoRA linear's adapter (AdaptedLinearParallel).
_LINEAR_DIMS = {"column": {"weight": 0, "bias": 0, "lora_B": 0}, "row": {"weight": 1, "lora_A": 1}}
_STYLE_DIMS = {**_LINEAR_DIMS, "vocab_embedding": {"weight": 0}, "vocab_head": {"weight": 0}}


def _has_adapter(module: nn.Module) -> bool:
    return isinstance(getattr(module, "lora_A", None), nn.Parameter)


def _style(module: nn.Module, name: str):
    """The style ``name`` for ``module``: :class:`AdaptedLinearParallel` for a linear with an
    adapter, torchao's float8 column / row style for its tensorwise ``Float8Linear``, else the
    plain one."""
    if name in _LINEAR_DIMS and _has_adapter(module):
        return AdaptedLinearParallel(name)
    if name in _LINEAR_DIMS and _tensorwise_float8(module):
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        return Float8ColwiseParallel() if name == "column" else Float8RowwiseParallel()
    return STYLES[name]()


def _tensorwise_float8(module: nn.Module) -> bool:
    """``module`` is torchao's ``Float8Linear`` with tensorwise scales (``training.float8``):
    its float8 TP styles cast the input before it is redistributed, with the scale of the whole
    tensor (amax reduced over the ranks). Rowwise layers keep the plain styles (torchao's float8
    styles assume tensorwise scales)."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")  # never imported: not float8
    if float8_linear is None or not isinstance(module, float8_linear.Float8Linear):
        return False
    from torchao.float8.config import ScalingGranularity

    return module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE


def apply_tp_plan(model: nn.Module, mesh, plan: dict) -> None:
    """Split ``model`` over the 1-D ``mesh`` as ``plan`` (see above) says."""
    styles = {k: _style(model.get_submodule(k), v) for k, v in plan.items() if isinstance(v, str)}
    if styles:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh, styles)
    for path, names in plan.items():
        if not isinstance(names, str):
            shard_parameters(model.get_submodule(path), list(names), mesh)


def tp_shard_dims(model: nn.Module, plan: dict) -> dict[str, int]:
    """{parameter name: the dim that ``plan`` shards it along over the tp ranks} (as torch.chunk
    splits it); parameters not named are replicated over tp."""
    out = {}
    for path, style in plan.items():
        module = model.get_submodule(path)
        for name, dim in (_STYLE_DIMS[style] if isinstance(style, str) else dict.fromkeys(style, 0)).items():
            if getattr(module, name, None) is not None:
                out[f"{path}.{name}"] = dim
    return out


def apply_tensor_parallel(module: nn.Module, mesh, plan: dict) -> None:
    """Split ``module``'s submodules over ``mesh`` as ``plan`` says ({submodule name: one of the
    styles above}); names of absent submodules (e.g. a pipeline stage without the head) are
    skipped."""
    from torch.distributed.tensor.parallel import parallelize_module

    present = {k: v for k, v in plan.items() if _has(module, k)}
    if present:
        parallelize_module(module, mesh, present)


def _has(module: nn.Module, name: str) -> bool:
    try:
        return module.get_submodule(name) is not None
    except AttributeError:
        return False


def shard_parameters(module: nn.Module, names: list[str], mesh, dim: int = 0) -> None:
    """Replace ``module``'s own parameters ``names`` (None ones skipped) by DTensors sharded
    along ``dim`` over ``mesh`` (same names, full shapes in checkpoints)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name in names:
        p = getattr(module, name)
        if p is None:
            continue
        assert p.shape[dim] % mesh.size() == 0, (name, tuple(p.shape), mesh.size())
        d = nn.Parameter(distribute_tensor(p.data, mesh, [Shard(dim)]), p.requires_grad)
        module.register_parameter(name, d)


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over ``group``'s ranks (a functional
    all-reduce, traceable by ``torch.compile``, also inside a checkpointed block)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        from torch.distributed import _functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(g.contiguous(), "sum", ctx.group)), None


class LocalSlice:
    """``t.narrow(dim, start, length)`` of a tensor that every tp rank computes whole (from
    replicated weights), with the gradient of ``t`` summed over the ranks in backward (each rank
    differentiates only its slice): the replicated weights then get the full gradient on every
    rank, as other replicated parameters do. Plain tensors and a process group, no DTensor: a
    checkpointed block compiled by AOT autograd must not save the mesh for backward."""

    def __init__(self, mesh, dim: int, start: int, length: int):
        self.group, self.dim, self.start, self.length = mesh.get_group(), dim, start, length

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return _SumGradOverRanks.apply(t, self.group).narrow(self.dim, self.start, self.length)

    def __repr__(self) -> str:
        return f"LocalSlice(dim={self.dim}, start={self.start}, length={self.length})"


class AdaptedLinearParallel(ParallelStyle):
    """Column- (``kind="column"``) or row-wise (``"row"``) split of a linear with a low-rank
    adapter, ``y = x W^T + b + s (x A^T) B^T``: the weight as ``ColwiseParallel`` /
    ``RowwiseParallel`` split it, the adapter along the same dim of the layer (``_LINEAR_DIMS``):

    * column: ``W``, ``b`` and ``B`` by output rows, ``A`` whole; the replicated input gives this
      rank's output columns of both terms (``x A^T`` is computed whole on every rank);
    * row: ``W`` and ``A`` by input columns, ``b`` and ``B`` whole; the sharded input gives
      partial sums of ``x W^T`` and of ``x A^T`` (then ``(x A^T)_r B^T``), added, and reduced in
      one all-reduce of the output.

    ``input_layout`` / ``output_layout``: the input's placement as it arrives and the output's as
    it leaves (defaults as torch's styles: column Replicate -> Shard(-1), row Shard(-1) ->
    Replicate). The module computes with :func:`grads_in_own_placements` of its adapters."""

    def __init__(self, kind: str, input_layout=None, output_layout=None):
        super().__init__()
        assert kind in _LINEAR_DIMS, kind
        self.kind = kind
        self.desired_input = Replicate() if kind == "column" else Shard(-1)
        self.input_layout = input_layout or self.desired_input
        self.output_layout = output_layout or (Shard(-1) if kind == "column" else Replicate())

    def _partition(self, name: str, module: nn.Module, mesh) -> None:
        if name:  # the dropout child: nothing to place
            return
        for pname, dim in _LINEAR_DIMS[self.kind].items():
            p = getattr(module, pname, None)
            if p is not None:  # the others are replicated by distribute_module
                module.register_parameter(pname, nn.Parameter(
                    distribute_tensor(p, mesh, [Shard(dim)], src_data_rank=self.src_data_rank),
                    requires_grad=p.requires_grad))

    def _input(self, module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
        if self.input_layout != self.desired_input:
            x = x.redistribute(placements=(self.desired_input,))
        return x

    def _output(self, module, y, mesh):
        if y.placements != (self.output_layout,):
            y = y.redistribute(placements=(self.output_layout,))
        return y.to_local()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        assert isinstance(module, nn.Linear) and _has_adapter(module), type(module)
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)

    def __repr__(self) -> str:
        return (f"AdaptedLinearParallel({self.kind}, input_layout={self.input_layout}, "
                f"output_layout={self.output_layout})")


def grads_in_own_placements(p: torch.Tensor) -> torch.Tensor:
    """``p`` as a computation uses it, its gradient arriving in ``p``'s own placements: a
    replicated adapter whose gradient the sharded computation leaves as per-rank partial sums
    (``Partial``) gets them all-reduced here, so that the optimizer, gradient clipping and FSDP2
    see a replicated gradient as for any replicated parameter. A plain tensor is returned as is."""
    if not isinstance(p, DTensor):
        return p
    return DTensor.from_local(p.to_local(), p.device_mesh, p.placements, run_check=False)


class SequenceParallel:
    """Sequence parallelism over the tp ranks (Megatron's, with tensor parallelism): between the
    tensor-parallel layers -- the residual stream and the norms -- each rank holds its part of
    the sequence (``torch.chunk`` of dim ``dim``, so any length), not the whole of it.

    * :meth:`shard`: a replicated tensor (the embeddings, a row-parallel layer's all-reduced
      output) -> this rank's part; backward all-gathers the parts' gradients.
    * :meth:`gather`: this rank's part -> the whole sequence (all-gather), as the tensor-parallel
      layers after it (whose input gradient is all-reduced: the same on every rank) take it;
      backward keeps this rank's part of that gradient.
    * :meth:`keep_part`: around the layers that take the gathered sequence: autograd keeps this
      rank's part instead of the gathered tensor and gathers it again in backward.
    * :meth:`sum_grad`: a replicated weight used on this rank's part only (a norm's): identity;
      backward sums its gradient over the ranks.
    """

    def __init__(self, mesh, dim: int = 1):
        self.mesh, self.dim = mesh, dim

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(t, self.mesh, [Replicate()], run_check=False).redistribute(
            self.mesh, [Shard(self.dim)]).to_local()

    def gather(self, t: torch.Tensor, length: int) -> torch.Tensor:
        """The whole sequence (``length`` along ``dim``) from every rank's part ``t``."""
        shape = list(t.shape)
        shape[self.dim] = length
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        d = DTensor.from_local(t, self.mesh, [Shard(self.dim)], run_check=False,
                               shape=torch.Size(shape), stride=tuple(stride))
        return d.redistribute(self.mesh, [Replicate()]).to_local()

    def keep_part(self, full: torch.Tensor, part: torch.Tensor):
        """A context in which autograd keeps this rank's ``part`` for the gathered ``full``
        (:meth:`gather`) -- for every saved tensor that is ``full`` or a view of it, DTensor or
        not -- and gathers it again when backward needs it (Megatron's sequence parallelism: the
        tensor-parallel layers' saved inputs cost 1/tp, for one more all-gather in backward)."""
        ptr, length = full.untyped_storage().data_ptr(), full.shape[self.dim]

        def pack(t):
            with torch.no_grad():
                local = local_tensor(t)
                try:
                    if local.untyped_storage().data_ptr() != ptr:
                        return t
                except RuntimeError:  # a storage-less tensor: not ``full``
                    return t
            spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
            return _GatheredView(local.shape, local.stride(), local.storage_offset(), spec)

        def unpack(x):
            if not isinstance(x, _GatheredView):
                return x
            with torch.no_grad():
                v = self.gather(part, length).as_strided(x.shape, x.stride, x.offset)
            if x.spec is None:
                return v
            mesh, placements, shape, stride = x.spec
            return DTensor.from_local(v, mesh, placements, run_check=False, shape=shape, stride=stride)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def sum_grad(self, w: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Partial

        return DTensor.from_local(w, self.mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])

    def __repr__(self) -> str:
        return f"SequenceParallel(dim={self.dim}, ranks={self.mesh.size()})"


@dataclass(frozen=True)
class _GatheredView:
    """What autograd keeps for a saved view of a gathered sequence (:meth:`SequenceParallel.keep_part`)."""

    shape: torch.Size
    stride: tuple
    offset: int
    spec: tuple | None
