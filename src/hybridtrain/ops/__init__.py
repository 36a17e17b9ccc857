"""Low-level numerics shared by models/ and training/ (below both; imports neither).

* :mod:`hybridtrain.ops.loss`: the chunked linear cross-entropy and per-token log-probabilities
  (:class:`~hybridtrain.ops.loss.LinearCrossEntropy`, ``cross_entropy_sum``, ``token_logprobs``).
  Its implementation (``training.fused_loss``): the PyTorch chunk loop, its chunk functions under
  ``torch.compile``, or :mod:`hybridtrain.ops.liger` (Liger-Kernel's fused Triton kernel).
* :mod:`hybridtrain.ops.backend`: hardware tuning (GEMM row alignment, the glibc allocator, the
  ``training.dtype: auto`` rule, the ``auto`` loss chunk, grouped GEMMs, the loss implementation,
  the Mamba kernel switch), configured once per process by the recipe with
  :func:`~hybridtrain.ops.backend.configure_backend`.
* :mod:`hybridtrain.ops.labels`: ``IGNORE_INDEX``, the label convention shared with ``data/``.
* :mod:`hybridtrain.ops.base2`: the base-2 constants of the fused autograd functions.
* :mod:`hybridtrain.ops.documents`: the documents' starts of packed rows, read to the host once
  per micro-batch for every eager layer that needs them.
"""
