"""Nemotron-H (hybrid Mamba2 / attention / MLP / MoE) in plain PyTorch, Hub-checkpoint compatible."""

from .config import NemotronHConfig
from .hf_io import CheckpointMismatchError
from .model import NemotronHForCausalLM, NemotronHModel
from .tiny import small_moe_config, tiny_config

__all__ = [
    "CheckpointMismatchError",
    "NemotronHConfig",
    "NemotronHForCausalLM",
    "NemotronHModel",
    "small_moe_config",
    "tiny_config",
]
