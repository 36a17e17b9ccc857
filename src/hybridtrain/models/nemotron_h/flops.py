"""FLOPs of a Nemotron-H model (its spec's ``batch_flops`` / ``layer_flops``).

Counting rules (one multiply-add = 2 FLOPs; forward pass unless ``training``):

* **Mamba2 mixer** (``linear_attention``), with d_in = mamba_num_heads * mamba_head_dim,
  h heads of size p, g groups, state size n, chunk size Q:
  in_proj ``2 H (2 d_in + 2 g n + h)``; depthwise causal conv1d ``2 k (d_in + 2 g n)``;
  the chunked SSD scan over a row padded to c chunks of Q tokens — per (padded) token
  ``2 g Q n`` (C.B inside a chunk, per group) + ``2 h Q p`` (its product with x) +
  ``2 h p n`` (chunk states) + ``2 h p n`` (state -> output), plus ``2 h p n`` per chunk for
  the recurrence that passes states between chunks; the gated RMSNorm ``9 d_in``
  (y * silu(z): 5, RMS statistics and scaling: 4); out_proj ``2 d_in H``.
  The scan runs over the packed row: documents restart the state but do not shorten the work.
* **Attention** (``full_attention``) with the configured ``head_dim`` (not hidden/heads) and GQA:
  q ``2 H a d``, k and v ``2 * 2 H kv d``, o ``2 a d H`` per token; scores and the weighted sum
  ``2 * 2 a d`` per (query, key) pair, counted **per document** of a packed row, over
  ``l^2 / 2`` pairs when ``causal`` (FlashAttention's convention) or ``l^2`` when not.
* **MLP** (``mlp``): relu^2, two projections: ``2 * 2 H I`` (+ ``2 I`` for the activation).
* **MoE** (``moe``): router ``2 H E`` (+ ``E`` sigmoid), ``top_k`` routed experts of two
  projections each ``2 * 2 H' I_moe`` where H' is ``moe_latent_size`` if set (plus the latent
  projections ``2 * 2 H H'``), and the shared expert MLP ``2 * 2 H I_shared`` (transformers builds
  one shared MLP of ``moe_shared_expert_intermediate_size``, whatever ``n_shared_experts`` says).
* **LM head** ``2 H V`` per position that gets logits: every token by default, or the label
  tokens only (``lm_head_tokens``), which is what the chunked training loss computes.
  Embedding lookups, residual adds and the pre-norms are not counted.
* **Training** = 3 x forward (backward = 2 x forward: gradients of inputs and of weights).

``matmul_only=True`` keeps the terms that are matrix products (GEMMs and the batched products
of attention and of the SSD scan) and drops conv1d, norms and activations; that is what
``torch.utils.flop_counter.FlopCounterMode`` measures (see tests/unit/test_flops.py). Peak
throughput and MFU: :mod:`hybridtrain.training.flops`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from hybridtrain.data.batch import IGNORE_INDEX


logger = logging.getLogger(__name__)

_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention", "M": "linear_attention",
                 "*": "full_attention", "-": "mlp", "E": "moe"}

# Terms that are not matrix products (excluded by ``matmul_only``).
NON_MATMUL_TERMS = frozenset({"mamba.conv1d", "mamba.gated_norm", "mlp.act", "moe.act", "moe.router_sigmoid"})

Docs = int | Sequence[int] | Sequence[Sequence[int]]


def _rows(doc_lengths: Docs) -> list[list[int]]:
    """Normalise to rows of document lengths: an int is one row holding one document; a list of
    ints is one packed row holding those documents; a list of lists is several rows."""
    if isinstance(doc_lengths, int):
        rows = [[doc_lengths]]
    else:
        seq = list(doc_lengths)
        if seq and all(isinstance(x, int) for x in seq):
            rows = [seq]
        else:
            rows = [list(r) for r in seq]
    for r in rows:
        if not r or any((not isinstance(x, int)) or isinstance(x, bool) or x <= 0 for x in r):
            raise ValueError(f"flops: document lengths must be positive ints, got row {r!r}")
    return rows


def _layer_types(config) -> list[str]:
    types = getattr(config, "layers_block_type", None)
    if types is None:
        types = list(getattr(config, "hybrid_override_pattern"))
    return [_LEGACY_TYPES.get(t, t) for t in types]


def layer_flops(config, layer_type: str, doc_lengths: Docs, causal: bool = True) -> dict[str, int]:
    """Forward FLOPs of one layer of ``layer_type`` over the given rows, by term."""
    layer_type = _LEGACY_TYPES.get(layer_type, layer_type)
    rows = _rows(doc_lengths)
    T = sum(sum(r) for r in rows)
    H = config.hidden_size
    if layer_type == "linear_attention":
        h, p, g, n, k, Q = (config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                            config.ssm_state_size, config.conv_kernel, config.chunk_size)
        d_in = h * p
        chunks = sum(math.ceil(sum(r) / Q) for r in rows)
        T_pad = chunks * Q
        return {
            "mamba.in_proj": 2 * T * H * (2 * d_in + 2 * g * n + h),
            "mamba.conv1d": 2 * T * k * (d_in + 2 * g * n),
            "mamba.ssd_intra_chunk": T_pad * (2 * g * Q * n + 2 * h * Q * p),
            "mamba.ssd_states": T_pad * 2 * (2 * h * p * n) + chunks * 2 * h * p * n,
            "mamba.gated_norm": 9 * T * d_in,
            "mamba.out_proj": 2 * T * d_in * H,
        }
    if layer_type == "full_attention":
        a, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        pairs = sum(l * l for r in rows for l in r)
        if causal:
            pairs //= 2
        return {
            "attention.qkv": 2 * T * H * (a + 2 * kv) * d,
            "attention.core": 2 * 2 * a * d * pairs,
            "attention.o": 2 * T * a * d * H,
        }
    if layer_type == "mlp":
        inter = config.intermediate_size
        return {"mlp.up": 2 * T * H * inter, "mlp.act": 2 * T * inter, "mlp.down": 2 * T * inter * H}
    if layer_type == "moe":
        E, top_k, inter = config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size
        latent = getattr(config, "moe_latent_size", None)
        d_e = latent or H
        out = {
            "moe.router": 2 * T * H * E,
            "moe.router_sigmoid": T * E,
            "moe.experts": top_k * T * 2 * (2 * d_e * inter),
            "moe.act": top_k * T * 2 * inter,
            "moe.shared": 2 * T * 2 * H * config.moe_shared_expert_intermediate_size,
        }
        if latent:
            out["moe.latent_proj"] = 2 * T * 2 * H * latent
        return out
    raise ValueError(
        f"flops: unknown layer type {layer_type!r}; expected linear_attention, full_attention, mlp or moe"
    )


def flops_breakdown(config, doc_lengths: Docs, causal: bool = True,
                    lm_head_tokens: int | None = None) -> dict[str, int]:
    """Forward FLOPs of the whole model over the given rows, summed by term over the layers.

    ``lm_head_tokens``: how many positions go through the LM head (default: all). The training
    loss computes logits for label tokens only (an SFT prompt has none), so the trainer passes
    the number of label tokens.
    """
    rows = _rows(doc_lengths)
    total: dict[str, int] = {}
    for t in _layer_types(config):
        for name, f in layer_flops(config, t, rows, causal).items():
            total[name] = total.get(name, 0) + f
    T = sum(sum(r) for r in rows) if lm_head_tokens is None else lm_head_tokens
    total["lm_head"] = 2 * T * config.hidden_size * config.vocab_size
    return total


def model_flops(
    config, doc_lengths: Docs, training: bool = True, causal: bool = True, matmul_only: bool = False,
    lm_head_tokens: int | None = None,
) -> int:
    """FLOPs of one forward (and backward when ``training``) pass over ``doc_lengths``: an int
    (one sequence), a list of document lengths of one packed row, or a list of such rows.
    ``lm_head_tokens``: see :func:`flops_breakdown`."""
    terms = flops_breakdown(config, doc_lengths, causal, lm_head_tokens)
    fwd = sum(f for name, f in terms.items() if not (matmul_only and name in NON_MATMUL_TERMS))
    return 3 * fwd if training else fwd


def flops_per_token(config, doc_lengths: Docs, training: bool = True, causal: bool = True,
                    lm_head_tokens: int | None = None) -> float:
    """:func:`model_flops` divided by the number of tokens."""
    tokens = sum(sum(r) for r in _rows(doc_lengths))
    return model_flops(config, doc_lengths, training=training, causal=causal,
                       lm_head_tokens=lm_head_tokens) / tokens


def batch_doc_lengths(batch: dict) -> list[list[int]]:
    """Rows of document lengths (padding excluded) of a collated batch: ``cu_seqlens`` segments
    of a packed batch, else each row's ``attention_mask`` count, else whole rows."""
    mask = batch.get("attention_mask")
    B, L = batch["input_ids"].shape
    if mask is None:
        return [[L] for _ in range(B)]
    if "cu_seqlens" not in batch:
        return [[int(n)] for n in mask.sum(1).tolist() if n > 0]
    flat = mask.reshape(-1).tolist()
    cu = batch["cu_seqlens"].tolist()
    rows: list[list[int]] = [[] for _ in range(B)]
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a and flat[a]:
            rows[a // L].append(b - a)
    return [r for r in rows if r]


def batch_flops(config, batch: dict, training: bool = True, ignore_index: int = IGNORE_INDEX) -> int:
    """Training (or forward) FLOPs of the model on one collated batch: attention per document,
    the LM head on the label tokens only (as the chunked loss computes it)."""
    rows = batch_doc_lengths(batch)
    if not rows:
        return 0
    n_label = int((batch["labels"] != ignore_index).sum()) if "labels" in batch else None
    return model_flops(config, rows, training=training, lm_head_tokens=n_label)
