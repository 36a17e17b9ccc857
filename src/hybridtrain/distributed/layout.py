"""From a recipe's ``distributed:`` section to the process group and the mesh.

::

    with process_group(cfg) as info:     # hybridtrain.distributed.init
        dims = parallel_dims_from_config(cfg.distributed, info.world_size, info.device.type)
        plan = parallelize(spec, model, dims, recipe.distributed, recipe.training, ...)

Sections are the typed objects of :mod:`hybridtrain.config.sections`, filled with their
defaults (``hybridtrain.config.recipe``, the one place each default is stated);
:func:`~hybridtrain.config.sections.config_section` makes one from a few keys (tests, API use).
"""

from __future__ import annotations

from hybridtrain.config.sections import DistributedSection, config_section
from hybridtrain.distributed.parallel_dims import ParallelDims

# config_section is config/sections.py's, importable from here too
__all__ = ["config_section", "parallel_dims_from_config"]


def parallel_dims_from_config(distributed: DistributedSection, world_size: int,
                              device_type: str = "cpu",
                              build_mesh: bool = True) -> ParallelDims:
    """Validated degrees; the named meshes are built (a collective) when there is more than
    one rank and ``build_mesh``."""
    d = config_section("distributed", distributed)
    dims = ParallelDims(dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, cp=d.cp, tp=d.tp,
                        pp=d.pp, ep=d.ep, world_size=world_size)
    if world_size > 1 and build_mesh:
        dims.build_mesh(device_type)
    return dims
