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

Parameters become DTensors on the ``tp`` mesh: checkpoints and exports hold full tensors, and a
checkpoint written under one layout loads under any other. FSDP2 then shards them over a 2-D
(data-parallel x tp) mesh: the ``tp`` mesh must be sliced from the same mesh view as FSDP's
(:func:`tp_mesh`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["tp_mesh", "column_parallel", "row_parallel", "vocab_parallel_embedding",
           "vocab_parallel_head", "apply_tensor_parallel", "shard_parameters", "LocalSlice",
           "check_divisible", "apply_tp_plan", "tp_shard_dims"]


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
_STYLE_DIMS = {"column": {"weight": 0, "bias": 0}, "row": {"weight": 1},  # (a row bias: replicated)
               "vocab_embedding": {"weight": 0}, "vocab_head": {"weight": 0}}


def apply_tp_plan(model: nn.Module, mesh, plan: dict) -> None:
    """Split ``model`` over the 1-D ``mesh`` as ``plan`` (see above) says."""
    styles = {k: STYLES[v]() for k, v in plan.items() if isinstance(v, str)}
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


class LocalSlice:
    """``t.narrow(dim, start, length)`` of a tensor that every tp rank computes whole (from
    replicated weights), with the gradient of ``t`` summed over the ranks in backward (each rank
    differentiates only its slice): the replicated weights then get the full gradient on every
    rank, as other replicated parameters do."""

    def __init__(self, mesh, dim: int, start: int, length: int):
        self.mesh, self.dim, self.start, self.length = mesh, dim, start, length

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        # identity forward; backward: this rank's gradient is a partial sum -> all-reduced
        t = DTensor.from_local(t, self.mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])
        return t.narrow(self.dim, self.start, self.length)

    def __repr__(self) -> str:
        return f"LocalSlice(dim={self.dim}, start={self.start}, length={self.length})"
