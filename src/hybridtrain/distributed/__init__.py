"""Multi-process training: device mesh, FSDP2/HSDP, pipeline and expert parallelism.

The generic machinery lives here (``apply_*`` steps, the pipeline schedule, :func:`parallelize`);
a model applies the steps to itself in its spec's ``parallelize_fn`` and is reached only
through its spec.
"""

from hybridtrain.distributed.init import DistInfo, destroy_distributed, init_distributed
from hybridtrain.distributed.layout import config_section, parallel_dims_from_config
from hybridtrain.distributed.parallel_dims import ParallelDims

__all__ = [
    "DistInfo", "ParallelDims", "init_distributed", "destroy_distributed", "config_section",
    "parallel_dims_from_config",
]
