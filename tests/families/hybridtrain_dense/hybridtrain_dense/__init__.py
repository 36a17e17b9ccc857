"""A plain dense decoder (RMSNorm, grouped-query attention with RoPE, SwiGLU MLP), the model
family ``dense_test``: a package outside hybridtrain that reaches it only through the model
spec it declares in its ``pyproject.toml`` (entry-point group ``hybridtrain.models``).
Parameter names follow the Llama layout of the Hub (``model.embed_tokens``,
``model.layers.<i>.self_attn.q_proj``, ...)."""

from hybridtrain_dense.model import DenseConfig, DenseLM

__all__ = ["DenseConfig", "DenseLM"]
