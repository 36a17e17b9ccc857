"""Moved to :mod:`hybridtrain.ops.backend` (``configure_backend`` applies
``training.cpu_allocator``); this name remains only until the recipe calls that."""

from hybridtrain.ops.backend import configure_cpu_allocator  # noqa: F401
