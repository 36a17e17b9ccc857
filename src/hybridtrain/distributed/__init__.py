"""Multi-process training: device mesh, FSDP2/HSDP, pipeline and expert parallelism.

The generic machinery lives here; a model applies it to itself in its own ``parallelize``
function (``hybridtrain.models.nemotron_h.parallelize``).
"""

from hybridtrain.distributed.init import DistInfo, destroy_distributed, init_distributed
from hybridtrain.distributed.layout import (
    init_options,
    parallel_dims_from_config,
    parallelize_options,
)
from hybridtrain.distributed.parallel_dims import ParallelDims

__all__ = [
    "DistInfo", "ParallelDims", "init_distributed", "destroy_distributed", "init_options",
    "parallel_dims_from_config", "parallelize_options",
]
