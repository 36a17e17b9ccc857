"""From a recipe's ``distributed:`` section to the process group and the mesh.

::

    with process_group(cfg) as info:     # hybridtrain.distributed.init
        dims = parallel_dims_from_config(cfg.distributed, info.world_size, info.device.type)
        plan = parallelize(spec, model, dims, cfg.distributed, cfg.training, ...)

Sections come filled with the schema's defaults (``hybridtrain.config.schema``, the one place
each default is stated); :func:`config_section` fills a plain dict the same way (tests, API use).
"""

from __future__ import annotations

from typing import Any, Mapping

from hybridtrain.config import build_config
from hybridtrain.distributed.parallel_dims import ParallelDims

__all__ = ["config_section", "parallel_dims_from_config"]


def config_section(name: str, values: Mapping[str, Any] | None = None):
    """The recipe section ``name`` with ``values`` over the schema defaults (validated: an unknown
    key is an error naming it)."""
    if values is not None and not isinstance(values, Mapping):
        return values  # already a loaded section
    return build_config({name: dict(values or {})})[name]


def parallel_dims_from_config(distributed, world_size: int, device_type: str = "cpu",
                              build_mesh: bool = True) -> ParallelDims:
    """Validated degrees; the named meshes are built (a collective) when there is more than
    one rank and ``build_mesh``."""
    d = config_section("distributed", distributed)
    dims = ParallelDims(dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, cp=d.cp, tp=d.tp,
                        pp=d.pp, ep=d.ep, world_size=world_size)
    if world_size > 1 and build_mesh:
        dims.build_mesh(device_type)
    return dims
