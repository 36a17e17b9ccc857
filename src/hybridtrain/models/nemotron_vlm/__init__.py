"""Nemotron-H vision-language model: RADIO-style ViT + pixel shuffle + MLP projector in front of
the Nemotron-H language model (see model.py)."""

from .build import build_vlm, tiny_vlm_config
from .config import NemotronVLMConfig, VisionConfig
from .model import MODULES, NemotronVLMForConditionalGeneration

__all__ = ["MODULES", "NemotronVLMConfig", "NemotronVLMForConditionalGeneration", "VisionConfig",
           "build_vlm", "tiny_vlm_config"]
