"""hybridtrain: a PyTorch-native trainer for hybrid Mamba-Transformer-MoE models."""

__version__ = "0.1.0"
