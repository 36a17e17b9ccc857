"""From a recipe's ``distributed:`` / ``training:`` sections to a mesh and parallelize options.

::

    info = init_distributed(cfg.training.device, **init_options(cfg.distributed))
    dims = parallel_dims_from_config(cfg.distributed, info.world_size, info.device.type)
    plan = parallelize_nemotron_h(model, dims, device=info.device, loss_fn=...,
                                  **parallelize_options(cfg.distributed, cfg.training))
"""

from __future__ import annotations

from typing import Any, Mapping

from hybridtrain.distributed.parallel_dims import ParallelDims

__all__ = ["init_options", "parallel_dims_from_config", "parallelize_options"]


def _get(section: Mapping | None, key: str, default: Any = None) -> Any:
    if section is None:
        return default
    value = section.get(key, default) if hasattr(section, "get") else getattr(section, key, default)
    return default if value is None and default is not None else value


def init_options(dcfg: Mapping | None) -> dict[str, Any]:
    """Keyword arguments of :func:`init_distributed` (backend, timeout)."""
    backend = _get(dcfg, "backend", "auto")
    timeout_s = _get(dcfg, "timeout_seconds", 1800)
    return {"backend": None if backend in (None, "auto") else backend,
            "timeout_minutes": float(timeout_s) / 60.0}


def parallel_dims_from_config(dcfg: Mapping | None, world_size: int, device_type: str = "cpu",
                              build_mesh: bool = True) -> ParallelDims:
    """Validated degrees; the named meshes are built (a collective) when there is more than
    one rank and ``build_mesh``."""
    dims = ParallelDims(
        dp_replicate=_get(dcfg, "dp_replicate", 1),
        dp_shard=_get(dcfg, "dp_shard", -1),
        cp=_get(dcfg, "cp", 1),
        tp=_get(dcfg, "tp", 1),
        pp=_get(dcfg, "pp", 1),
        ep=_get(dcfg, "ep", 1),
        world_size=world_size,
    )
    if world_size > 1 and build_mesh:
        dims.build_mesh(device_type)
    return dims


def parallelize_options(dcfg: Mapping | None, tcfg: Mapping | None = None) -> dict[str, Any]:
    """Keyword arguments of ``parallelize_nemotron_h`` from the recipe's sections."""
    return {
        "activation_checkpointing": _get(tcfg, "activation_checkpointing", False),
        "compile": bool(_get(tcfg, "compile", False)),
        "param_dtype": _get(dcfg, "fsdp_param_dtype", "auto"),
        "reduce_dtype": _get(dcfg, "fsdp_reduce_dtype", "float32"),
        "reshard_after_forward": _get(dcfg, "fsdp_reshard_after_forward", "default"),
        "cpu_offload": bool(_get(dcfg, "cpu_offload", False)),
        "ep_backend": _get(dcfg, "ep_backend", "alltoall"),
        "pp_schedule": _get(dcfg, "pp_schedule", "1f1b"),
        "pp_stages_per_rank": _get(dcfg, "pp_stages_per_rank", None),
        "pp_microbatch_size": _get(dcfg, "pp_microbatch_size", None),
        "pp_split_points": _get(dcfg, "pp_split_points", None),
    }
