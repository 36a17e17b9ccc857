"""Activation memory of the vision-language model per micro-batch (its spec's
``MemoryPlanSupport``; see :mod:`hybridtrain.training.memory_plan`): the language model's layers and
head as Nemotron-H estimates them (:mod:`hybridtrain.models.nemotron_h.memory`) and, on the
first pipeline stage, the vision encoder and projector on the micro-batch's images.

The images of a micro-batch, from the recipe's data sections: one image per sample (LLaVA-style
data), every image at the dataset's ``max_patches`` patches (the data layer's bound); a row is
one sample, or packed, as many samples as its ``pack_size`` tokens hold whole images (an image
of ``P`` patches takes ``P / merge^2`` placeholder tokens): the most such data can carry.

Per ViT block of ``T`` tokens (patches plus class tokens) of width ``D``, MLP width ``I``,
``e`` bytes per element, what autograd keeps: the block input and the residual sum (the
LayerNorms' inputs), both norms' outputs (the linears' inputs), q/k/v (one storage), the
attention output and its re-laid-out copy (the projection's input), the MLP's hidden before
and after GELU; fp32 per token: the norms' mean and inverse deviation, the attention's
log-sum-exp per head. Besides: the patch embedding's input (the pixels), the final norm's
input, and the projector's RMSNorm input and output and its squared-ReLU hidden on the
merged tokens. A frozen vision encoder runs without autograd (nothing kept); under activation
checkpointing each ViT block keeps its input only, and its backward recomputes one block.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from hybridtrain.data.vision_chat import VisionChatDataset
from hybridtrain.models.nemotron_h.memory import activation_bytes as lm_activation_bytes
from hybridtrain.models.spec import ActivationBytes, EncoderActivations

from .config import NemotronVLMConfig

__all__ = ["activation_bytes", "encoder_activation_bytes", "images_per_micro_batch",
           "vision_activation_bytes"]

_F32 = 4
_MAX_PATCHES = inspect.signature(VisionChatDataset).parameters["max_patches"].default


def activation_bytes(config: NemotronVLMConfig, *args, **kwargs) -> ActivationBytes:
    """The language model's layers and head (Nemotron-H's estimate on ``text_config``)."""
    return lm_activation_bytes(config.text_config, *args, **kwargs)


def images_per_micro_batch(config: NemotronVLMConfig, micro_batch: int, seq_len: int,
                           recipe) -> tuple[int, int]:
    """(images, patches) of a micro-batch of ``micro_batch`` rows of ``seq_len`` tokens under
    ``recipe`` (its ``dataset`` and ``packing`` sections; see the module docstring)."""
    max_patches = int((recipe.dataset or {}).get("max_patches") or _MAX_PATCHES)
    per_row = 1
    if recipe.packing.enabled:
        per_row = max(1, seq_len // max(1, max_patches // config.merge ** 2))
    return micro_batch * per_row, micro_batch * per_row * max_patches


def vision_activation_bytes(config: NemotronVLMConfig, images: int, patches: int,
                            dtype: torch.dtype, vision_trains: bool = True,
                            checkpointed: bool = False) -> dict[str, float]:
    """{"vision": bytes the encoder and projector keep for backward, "backward": what one
    block's backward works with (its recompute when checkpointed)} for ``images`` images of
    ``patches`` patches in all."""
    v, e = config.vision_config, torch.empty((), dtype=dtype, device="meta").element_size()
    D, I, H = v.hidden_size, v.intermediate_size, v.num_attention_heads
    T = patches + images * v.class_token_len
    block = T * e * (9 * D + 2 * I) + T * _F32 * (4 + H)
    M, d_in = patches // config.merge ** 2, D * config.merge ** 2
    projector = M * e * (2 * d_in + config.projector_hidden_size) + M * _F32
    if not vision_trains:
        return {"vision": float(projector), "backward": 0.0}
    kept = T * D * e if checkpointed else block
    encoder = (patches * v.patch_dim * e + v.num_hidden_layers * kept
               + T * D * e + 2 * T * _F32)  # pixels, blocks, final norm
    return {"vision": float(encoder + projector), "backward": float(block if checkpointed else 0)}


def encoder_activation_bytes(model: nn.Module, micro_batch: int, seq_len: int,
                             dtype: torch.dtype, recipe) -> EncoderActivations:
    """What the first stage's vision encoder and projector keep per micro-batch
    (``MemoryPlanSupport.encoder_activation_bytes``): the images :func:`images_per_micro_batch`
    bounds; blocks checkpointed as :func:`~hybridtrain.models.nemotron_vlm.spec.parallelize_vlm`
    checkpoints them (all, when ``training.activation_checkpointing`` is on); ``inputs``: the
    micro-batch's pixels (fp32, as collated)."""
    if model.vision_model is None:
        return EncoderActivations()
    images, patches = images_per_micro_batch(model.config, micro_batch, seq_len, recipe)
    inputs = float(patches * model.config.vision_config.patch_dim * _F32)
    trains = any(p.requires_grad for p in model.vision_model.parameters())
    if not trains and not any(p.requires_grad for p in model.projector.parameters()):
        return EncoderActivations(inputs=inputs)
    est = vision_activation_bytes(model.config, images, patches, dtype, trains,
                                  bool(recipe.training.activation_checkpointing))
    return EncoderActivations({"vision": est["vision"]}, est["backward"], inputs)
