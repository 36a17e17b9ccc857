"""Moved to :mod:`hybridtrain.ops.loss` (below models/ and training/); this name remains only
until the trainer and the recipe import it from there."""

from hybridtrain.ops.loss import DEFAULT_CHUNK_SIZE, cross_entropy_sum  # noqa: F401
