"""FLOPs accounting against torch.utils.flop_counter.FlopCounterMode.

What FlopCounterMode counts, and how it is compared with hybridtrain.models.nemotron_h.flops:

* It counts matmul-like aten ops only: mm / addmm / bmm / baddbmm (every nn.Linear, the router,
  the per-expert GEMMs or the experts' grouped GEMMs, mapped below, the SSD scan's einsums, which lower to bmm), convolution, and the fused
  attention kernels it has formulas for. Elementwise work (norms, activations, softmax, the SSD
  decays and masks) is never counted, so we compare with ``matmul_only=True``.
* Convolution is left out of the comparison: the depthwise conv1d is not a matmul in our
  accounting, it runs as elementwise shifts on packed rows, and FlopCounterMode's formula for
  its backward does not account for ``groups``.
* CPU attention runs ``_scaled_dot_product_flash_attention_for_cpu``, for which torch has no
  formula (it would count 0); we map it, and its backward, to torch's own sdpa formulas through
  ``custom_mapping``. Those count every (query, key) pair, masked or not, so the comparison uses
  ``causal=False``; hybridtrain's MFU figure counts causal attention as half of that (FA's
  convention). On a packed row the model runs one masked attention over the whole row, so the
  kernel's count is the row's L^2, while the model FLOPs credit only each document's l^2: the
  packed test checks both against measured figures.
* The sdpa backward recomputes the scores: torch counts it as 2.5x the forward, not 2x.
* The pure-PyTorch SSD's backward recomputes the in-chunk C.B products, the chunk-end states
  and the chunk-to-chunk state passing instead of saving them (models/nemotron_h/ssd.py): the
  FLOPs it does on top of 2x the forward are added explicitly below, like the sdpa recompute.
* The pure-PyTorch SSD passes states between chunks with one dense [c+1, c+1] einsum
  (2 h p n (c+1)^2 FLOPs per row); the model FLOPs count the recurrence it stands for,
  2 h p n c (what the mamba_ssm kernel runs). The difference is added explicitly below.
"""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
from hybridtrain.models.nemotron_h.flops import (
    batch_flops,
    flops_breakdown,
    flops_per_token,
    layer_flops,
    model_flops,
)
from hybridtrain.ops.loss import cross_entropy_sum
from hybridtrain.training.flops import gpu_peak_tflops, measure_matmul_peak, mfu, peak_tflops

aten = torch.ops.aten
_CPU_SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_shape=None, **kw: sdpa_flop_count(q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda go, q, k, v, *a, out_shape=None, **kw: sdpa_backward_flop_count(go, q, k, v),
    # the experts' grouped GEMMs (torch has no formula for them): every row of a times its
    # group's [k, n] block of b, in each of its forms (2D x 3D, the weight gradient's 2D x 2D)
    aten._grouped_mm: lambda a, b, *args, out_shape=None, **kw: 2 * math.prod(a) * b[-1],
}
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_efficient_attention_backward"}
_SDPA_FWD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention"}

# The model package's tiny configs, with head_dim != hidden / heads (16) so that a count using
# hidden / heads fails, and a chunk_size that does not divide the test lengths.
CONFIGS = {
    "dense": dict(kind="dense"),
    "moe": dict(kind="moe"),
    "mixed": dict(kind="mixed"),
    "attention_only": dict(kind="dense", hybrid_override_pattern="*-*-"),
    "moe_latent": dict(kind="moe", moe_latent_size=32),
}


def _config(name):
    return tiny_config(**CONFIGS[name], head_dim=24, chunk_size=16)


def _op_name(op):
    return str(op).split(".")[1]


def _counted(counts: dict) -> tuple[int, int]:
    """(matmul FLOPs, of which sdpa forward) from one FlopCounterMode module entry."""
    total = sum(f for op, f in counts.items() if _op_name(op) in _MATMUL_OPS)
    sdpa = sum(f for op, f in counts.items() if _op_name(op) in _SDPA_FWD)
    return total, sdpa


def _dense_state_passing_extra(config, row_lengths):
    """FLOPs the dense chunk-passing einsum adds over the recurrence, per Mamba layer."""
    h, p, n, Q = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size, config.chunk_size
    extra = 0
    for L in row_lengths:
        c = math.ceil(L / Q)
        extra += 2 * h * p * n * ((c + 1) ** 2 - c)
    return extra


def _ssd_backward_recompute(config, row_lengths):
    """Matmul FLOPs the SSD backward recomputes per Mamba layer: C.B, the chunk-end states and
    the dense state passing."""
    h, p, g, n, Q = (config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size,
                     config.chunk_size)
    extra = 0
    for L in row_lengths:
        c = math.ceil(L / Q)
        extra += c * Q * (2 * g * Q * n + 2 * h * p * n) + 2 * h * p * n * (c + 1) ** 2
    return extra


def _expected_by_layer(config, rows, training, counted_sdpa_fwd):
    """Expected FlopCounterMode matmul FLOPs of every layer and of the LM head."""
    mult = 3 if training else 1
    out = {}
    for i, t in enumerate(config.layers_block_type):
        terms = layer_flops(config, t, rows, causal=False)
        fwd = sum(f for name, f in terms.items() if name not in ("mamba.conv1d", "mamba.gated_norm", "mlp.act",
                                                                  "moe.act", "moe.router_sigmoid"))
        if t == "linear_attention":
            fwd += _dense_state_passing_extra(config, [sum(r) for r in rows])
        exp = mult * fwd
        if training and t == "full_attention":
            exp += counted_sdpa_fwd[i] // 2  # the backward's recompute of the scores
        if training and t == "linear_attention":
            exp += _ssd_backward_recompute(config, [sum(r) for r in rows])
        out[f"layers.{i}"] = exp
    out["lm_head"] = mult * 2 * sum(map(sum, rows)) * config.hidden_size * config.vocab_size
    return out


class _LossWrapper(torch.nn.Module):
    """Training forward as the trainer runs it: hidden states, then the linear cross-entropy.
    (A module, so that FlopCounterMode names the layers by their full path.)"""

    def __init__(self, model, ce_chunk, ce_recompute):
        super().__init__()
        self.model, self.ce_chunk, self.ce_recompute = model, ce_chunk, ce_recompute

    def forward(self, input_ids, labels, cu_seqlens=None):
        h = self.model.hidden_states(input_ids, cu_seqlens=cu_seqlens)
        return cross_entropy_sum(h, self.model.lm_head.weight, labels, chunk_size=self.ce_chunk,
                                 recompute=self.ce_recompute)


def _measure(model, input_ids, training, cu_seqlens=None, ce_chunk=None, ce_recompute=False):
    model.zero_grad(set_to_none=True)
    labels = torch.randint(0, model.config.vocab_size, input_ids.shape)
    wrapper = _LossWrapper(model, ce_chunk, ce_recompute)
    with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA) as fc:
        if training:
            wrapper(input_ids, labels, cu_seqlens=cu_seqlens).backward()
        else:
            model(input_ids, cu_seqlens=cu_seqlens)
    counts = fc.get_flop_counts()
    prefix = "_LossWrapper.model" if training else type(model).__name__
    layers = {}
    sdpa = {}
    for i in range(model.config.num_hidden_layers):
        layers[f"layers.{i}"], sdpa[i] = _counted(counts[f"{prefix}.backbone.layers.{i}"])
    total, _ = _counted(counts["Global"])
    # the head's matmuls run inside cross_entropy_sum (outside the lm_head module) when used
    layers["lm_head"] = total - sum(layers.values())
    return layers, sdpa, total


def _assert_within(measured: dict, expected: dict, rel=0.05):
    for key, want in expected.items():
        got = measured[key]
        assert abs(got - want) <= rel * want, f"{key}: FlopCounterMode {got} vs formula {want}"


@pytest.mark.parametrize("pattern", sorted(CONFIGS))
@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_matmul_flops_match_flop_counter(pattern, training):
    torch.manual_seed(0)
    config = _config(pattern)
    model = NemotronHForCausalLM(config)
    L = 50  # not a multiple of chunk_size: the SSD pads the last chunk
    ids = torch.randint(0, config.vocab_size, (2, L))
    measured, sdpa, total = _measure(model, ids, training)
    rows = [[L], [L]]
    expected = _expected_by_layer(config, rows, training, sdpa)
    _assert_within(measured, expected)
    # and the public total agrees with the per-layer sum (less the implementation extras)
    extras = sum(expected.values()) - model_flops(config, rows, training=training, causal=False, matmul_only=True)
    assert total - extras == pytest.approx(model_flops(config, rows, training, causal=False, matmul_only=True), rel=0.05)


def test_chunked_cross_entropy_head_matmuls():
    """The chunked loss forms its gradients in forward (3 LM-head matmuls, as the plain loss) or,
    with ``recompute=True``, recomputes the chunk logits in backward (one more)."""
    torch.manual_seed(0)
    config = _config("mixed")
    model = NemotronHForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, 40))
    head_fwd = 2 * 40 * config.hidden_size * config.vocab_size
    for ce_chunk, recompute, n_matmuls in [(None, False, 3), (16, False, 3), (16, True, 4)]:
        measured, _, _ = _measure(model, ids, training=True, ce_chunk=ce_chunk, ce_recompute=recompute)
        assert measured["lm_head"] == n_matmuls * head_fwd, (ce_chunk, recompute)
    # Only label tokens go through the chunked head (an SFT prompt has none).
    labels = torch.full(ids.shape, -100)
    labels[:, 30:] = torch.randint(0, config.vocab_size, (1, 10))
    h = model.hidden_states(ids).detach().requires_grad_()
    with FlopCounterMode(display=False) as fc:
        cross_entropy_sum(h, model.lm_head.weight, labels, chunk_size=16).backward()
    assert fc.get_total_flops() == 3 * head_fwd // 4  # 10 of the 40 tokens
    assert torch.all(h.grad[:, :30] == 0) and torch.any(h.grad[:, 30:] != 0)


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_packed_row_counts_attention_per_document(training):
    torch.manual_seed(0)
    config = _config("mixed")
    model = NemotronHForCausalLM(config)
    docs = [20, 7, 23]  # one packed row of 50 tokens
    ids = torch.randint(0, config.vocab_size, (1, sum(docs)))
    cu = torch.tensor([0, 20, 27, 50])
    # What runs on the packed row: the Mamba scan over the whole row, and attention per document
    # (ops.attention: one SDPA call per document, no [L, L] mask).
    measured, sdpa, _ = _measure(model, ids, training, cu_seqlens=cu)
    _assert_within(measured, _expected_by_layer(config, [docs], training, sdpa))
    # What the model FLOPs credit: attention per document. Measured by running each document
    # alone; the per-document attention core equals the formula's for the packed row.
    attn_layer = config.layers_block_type.index("full_attention")
    per_doc_sdpa = 0
    for n in docs:
        _, s, _ = _measure(model, ids[:, :n], training=False)
        per_doc_sdpa += s[attn_layer]
    assert layer_flops(config, "full_attention", docs, causal=False)["attention.core"] == per_doc_sdpa
    assert per_doc_sdpa == sdpa[attn_layer] or training  # (training counts include the backward)
    # The other terms of the packed row do not depend on where the documents start.
    packed, row = flops_breakdown(config, docs), flops_breakdown(config, [50])
    assert {k: v for k, v in packed.items() if k != "attention.core"} == {
        k: v for k, v in row.items() if k != "attention.core"
    }
    n_attn = config.layers_block_type.count("full_attention")
    assert packed["attention.core"] == n_attn * 4 * config.num_attention_heads * config.head_dim * sum(n * n for n in docs) // 2


def test_formula_terms_by_hand():
    """Independent hand count for a 1-layer model of each kind, one token: the per-token linear
    terms are 2 x (parameters of the matrices a token goes through)."""
    c = _config("mixed")
    H, V = c.hidden_size, c.vocab_size
    # attention: q, k, v, o with head_dim 24 and 2 kv heads
    att = layer_flops(c, "full_attention", 1)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 24)
    assert att["attention.qkv"] == 2 * H * (4 * 24 + 2 * 2 * 24)
    assert att["attention.o"] == 2 * 4 * 24 * H
    # MLP: two projections (not three)
    mlp = layer_flops(c, "mlp", 1)
    assert mlp["mlp.up"] + mlp["mlp.down"] == 2 * 2 * H * c.intermediate_size
    # MoE: router + top-2 of the routed experts + the shared expert
    moe = layer_flops(c, "moe", 1)
    assert moe["moe.router"] == 2 * H * c.n_routed_experts
    assert moe["moe.experts"] == c.num_experts_per_tok * 2 * (2 * H * c.moe_intermediate_size)
    assert moe["moe.shared"] == 2 * 2 * H * c.moe_shared_expert_intermediate_size
    # Mamba in_proj: z, x, B, C, dt
    mam = layer_flops(c, "linear_attention", 1)
    d_in, g, n, nh = c.mamba_num_heads * c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.mamba_num_heads
    assert mam["mamba.in_proj"] == 2 * H * (2 * d_in + 2 * g * n + nh)
    assert mam["mamba.out_proj"] == 2 * d_in * H
    # causal attention is half the pairs; training is 3x forward; LM head 2 H V per token
    assert layer_flops(c, "full_attention", 10)["attention.core"] * 2 == layer_flops(
        c, "full_attention", 10, causal=False)["attention.core"]
    assert model_flops(c, 10, training=True) == 3 * model_flops(c, 10, training=False)
    assert flops_breakdown(c, 1)["lm_head"] == 2 * H * V
    assert flops_breakdown(c, [10, 20], lm_head_tokens=3)["lm_head"] == 3 * 2 * H * V
    assert model_flops(c, 30) - model_flops(c, 30, lm_head_tokens=5) == 3 * 25 * 2 * H * V
    assert flops_per_token(c, [10, 20], training=False) == model_flops(c, [10, 20], training=False) / 30


def test_batch_flops_of_padded_and_packed_batches():
    c = _config("mixed")
    padded = {"input_ids": torch.zeros(2, 8, dtype=torch.long),
              "attention_mask": torch.tensor([[1] * 5 + [0] * 3, [1] * 8]),
              "labels": torch.tensor([[-100] * 3 + [1, 2] + [-100] * 3, [-100] * 6 + [3, 4]])}
    assert batch_flops(c, padded) == model_flops(c, [[5], [8]], lm_head_tokens=4)
    packed = {"input_ids": torch.zeros(2, 8, dtype=torch.long),
              "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2]),
              "cu_seqlens": torch.tensor([0, 3, 8, 14, 16]),
              "labels": torch.full((2, 8), 5)}
    assert batch_flops(c, packed) == model_flops(c, [[3, 5], [6]], lm_head_tokens=16)


def test_legacy_layer_names_and_bad_input():
    c = _config("mixed")
    assert layer_flops(c, "mamba", 8) == layer_flops(c, "linear_attention", 8)
    assert layer_flops(c, "attention", 8) == layer_flops(c, "full_attention", 8)
    with pytest.raises(ValueError, match="unknown layer type"):
        layer_flops(c, "conv", 8)
    with pytest.raises(ValueError, match="positive"):
        model_flops(c, [10, 0])


def test_peak_table_and_mfu():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert gpu_peak_tflops("NVIDIA H200", "fp32") == 67.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert gpu_peak_tflops("NVIDIA B200", "fp16") == 2250.0
    assert gpu_peak_tflops("Tesla T4", "bf16") is None
    with pytest.raises(ValueError, match="dtype"):
        gpu_peak_tflops("NVIDIA H100", "int8")
    assert mfu(494.7, 989.4) == pytest.approx(0.5)
    assert mfu(1.0, None) is None


def test_cpu_measured_peak_is_positive_and_cached():
    p = measure_matmul_peak("fp32", n=256, iters=2)
    assert p > 0 and measure_matmul_peak("fp32", n=256, iters=2) == p
    assert peak_tflops("cpu", torch.float32) > 0
