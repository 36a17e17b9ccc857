"""The RL backend: a recipe's model as a :class:`Policy` (log-probs, top-k logits, one optimizer
step with a supplied loss, Hub-named weights, checkpoints) under every layout, and NeMo-RL's
losses (:mod:`hybridtrain.rl.losses`)."""

from hybridtrain.rl.losses import ClippedPGLoss, DPOLoss, NLLLoss
from hybridtrain.rl.policy import Policy

__all__ = ["Policy", "NLLLoss", "ClippedPGLoss", "DPOLoss"]
