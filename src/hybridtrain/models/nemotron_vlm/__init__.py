"""Nemotron-H vision-language model: RADIO-style ViT + pixel shuffle + MLP projector in front of
the Nemotron-H language model (see model.py)."""

from .build import build_vlm, tiny_vlm_config
from .config import NemotronVLMConfig, VisionConfig
from .model import MODULES, NemotronVLMForConditionalGeneration
from .tiny_omni import write_tiny_omni

__all__ = ["MODULES", "NemotronVLMConfig", "NemotronVLMForConditionalGeneration", "VisionConfig",
           "build_vlm", "tiny_vlm_config", "write_tiny_omni"]
