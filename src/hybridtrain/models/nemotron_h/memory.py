"""Activation memory of Nemotron-H per micro-batch: what each block keeps for backward and what
its backward works with at once (the memory plan's model-specific part,
``MemoryPlanSupport.activation_bytes``; see :mod:`hybridtrain.training.memory_plan`).

An estimate, counted from the forward and backward code, with ``T = micro_batch * seq_len``
tokens, ``e`` the activation dtype's bytes and fp32 where the model computes in fp32 (norm
statistics, router, SSD ``dt`` / decays / states, the loss's logits). A rank's peak is what the
micro-batches in flight keep plus one block's backward working set (or the loss's), so the
two are counted apart. Kept per block type:

* every block: its input (kept by the pre-norm) and the per-token inverse RMS;
* Mamba2: the norm output (in_proj input), the in_proj output (z | xBC | dt: one storage, kept
  by the gated norm and the conv), the conv output (x, B, C of the scan), ``dt`` after softplus
  (fp32), the scan's fp32 ``x * dt`` and its B/C copies, the scan output and the gated-norm
  output (out_proj input); the chunk states are recomputed in backward, not kept;
* attention: the norm output, q/k/v, the attention output and its re-laid-out copy (o_proj
  input), the log-sum-exp (flash / memory-efficient attention: no ``L x L`` matrix);
* MLP: the norm output, ReLU output and its square (down_proj input);
* MoE: the norm output and, in low precision, its fp32 copy (router input), router scores
  (fp32), the ``k`` sorted token copies, the experts' ReLU / square outputs, the fp32 expert
  outputs the gate weights multiply, and the shared expert's MLP activations.

Backward working set (above what the block keeps): three gradients of the hidden width (the
one arriving, its residual branch's, the mixer input's) and the mixer's own: Mamba2's scan recomputes the chunk states
and passes their gradients between chunks (six tensors of the states' size live at once:
states, start states, their gradients and the state passing's own), with three fp32 tensors
of the scan's width (the incoming gradient, ``x * dt * w`` and the diagonal blocks' input
gradient) and two of the in-chunk decays; attention: the gradients of q/k/v and of the output;
an MLP: two of its hidden width; MoE: two of the routed experts' hidden width or two of the
shared expert's, the wider (the shared expert's backward ends before the routed experts' starts).

A checkpointed block keeps only its input. The last stage adds the final norm and the chunked
linear cross-entropy: kept per micro-batch until its backward, the final norm's input and
statistics, the hidden-state gradient it forms in forward, the log-sum-exp and the head
weight's fp32 gradient accumulator (when the head trains); while it runs, one chunk's logits,
their fp32 exponentials (which become the gradient) and its low-precision copy
(``loss_chunk_size: null``: every token's logits at once). Every token is counted as a label
token (prompt-masked rows hold fewer: the loss forms logits for label tokens only).
"""

from __future__ import annotations

import torch

from hybridtrain.models.spec import ActivationBytes, LayerActivations
from hybridtrain.ops.backend import auto_chunk_size

from .config import NemotronHConfig

__all__ = ["activation_bytes", "CATEGORY"]

# block type -> the plan's category name
CATEGORY = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
_F32 = 4


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _mamba(c: NemotronHConfig, T: int, e: int) -> float:
    H, I, nh = c.hidden_size, c.mamba_intermediate_size, c.mamba_num_heads
    bc = 2 * c.n_groups * c.ssm_state_size
    return (T * e * (H + (I + c.mamba_conv_dim + nh) + c.mamba_conv_dim + bc + 2 * I)
            + T * _F32 * (nh + I))


def _mamba_backward(c: NemotronHConfig, T: int, e: int) -> float:
    nh, cs = c.mamba_num_heads, c.chunk_size
    states = -(-T // cs) * nh * c.mamba_head_dim * c.ssm_state_size * _F32
    return 6 * states + 3 * T * c.mamba_intermediate_size * _F32 + 2 * T * nh * cs * _F32


def _attention(c: NemotronHConfig, T: int, e: int) -> float:
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return T * e * (c.hidden_size + q + 2 * kv + 2 * q) + T * _F32 * c.num_attention_heads


def _attention_backward(c: NemotronHConfig, T: int, e: int) -> float:
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return T * e * (2 * q + 2 * kv)


def _mlp(c: NemotronHConfig, T: int, e: int, inter: int | None = None) -> float:
    return T * e * (c.hidden_size + 2 * (inter or c.intermediate_size))


def _mlp_backward(c: NemotronHConfig, T: int, e: int) -> float:
    return 2 * T * e * c.intermediate_size


def _moe(c: NemotronHConfig, T: int, e: int) -> float:
    H, k = c.hidden_size, c.num_experts_per_tok
    d = c.moe_latent_size or H  # the experts' input width
    routed = T * k * (d * e + 2 * c.moe_intermediate_size * e + d * _F32)
    router = T * ((H * _F32 if e != _F32 else 0) + 2 * c.n_routed_experts * _F32 + 2 * k * _F32)
    latent = T * e * (H + d) if c.moe_latent_size else 0
    return (routed + router + latent
            + _mlp(c, T, e, c.moe_shared_expert_intermediate_size))


def _moe_backward(c: NemotronHConfig, T: int, e: int) -> float:
    # the shared expert's backward runs, then the routed experts': the wider one at a time
    return 2 * T * e * max(c.num_experts_per_tok * c.moe_intermediate_size,
                           c.moe_shared_expert_intermediate_size)


_MIXER = {"linear_attention": _mamba, "full_attention": _attention, "mlp": _mlp, "moe": _moe}
_BACKWARD = {"linear_attention": _mamba_backward, "full_attention": _attention_backward,
             "mlp": _mlp_backward, "moe": _moe_backward}


def activation_bytes(config: NemotronHConfig, micro_batch: int, seq_len: int,
                     dtype: torch.dtype, loss_chunk_size: int | str | None = "auto",
                     head_grad: bool = True) -> ActivationBytes:
    """Bytes of one micro-batch of ``micro_batch`` rows of ``seq_len`` tokens (the contract's
    :class:`~hybridtrain.models.spec.ActivationBytes`; its ``loss``: what the final norm, the
    loss and the multi-token prediction layers with their losses keep on the last stage).
    ``head_grad``: whether the LM head trains (its fp32 gradient is accumulated in forward)."""
    T, e = micro_batch * seq_len, _bytes(dtype)
    block_in = T * config.hidden_size * e
    layers = []
    for t in config.layers_block_type:
        saved = block_in + T * _F32 + _MIXER[t](config, T, e)
        layers.append(LayerActivations(t, CATEGORY[t], saved=float(saved),
                                       checkpointed=float(block_in),
                                       backward=float(3 * block_in + _BACKWARD[t](config, T, e))))
    V, H = config.vocab_size, config.hidden_size
    chunk = auto_chunk_size(V) if loss_chunk_size == "auto" else loss_chunk_size
    chunk = T if chunk is None else min(int(chunk), T)
    kept = (block_in + T * _F32  # final norm
            + T * H * e + T * _F32  # the hidden-state gradient, log-sum-exp
            + (V * H * _F32 if head_grad else 0))
    # the multi-token prediction depths run after the main loss on the same stage and keep, per
    # depth, the fused input (embeddings, both norms, the 2H concat), each layer's activations
    # (as without checkpointing: an upper bound), the final norm and their loss's hidden
    # gradient and log-sum-exp
    for t in (config.mtp_layers_block_type or ()) * config.num_nextn_predict_layers:
        kept += block_in + T * _F32 + _MIXER[t](config, T, e)
    kept += config.num_nextn_predict_layers * (4 * block_in + 2 * block_in + 2 * T * _F32 + T * H * e)
    # one chunk's logits, fp32 exponentials (the fp32 logits' own buffer), low-precision copy
    working = chunk * V * (_F32 if e == _F32 else 2 * e + _F32)
    return ActivationBytes(tuple(layers), loss=float(kept), loss_backward=float(working))
