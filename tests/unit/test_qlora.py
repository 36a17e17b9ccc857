"""QLoRA (``peft.base_quant: nf4``): the frozen base of every LoRA target in torchao's NF4,
experts included; what stays unquantised; the adapted model computes as LoRA on the dequantised
base; merging dequantises."""

import copy
import logging

import pytest
import torch

pytest.importorskip("torchao", reason="peft.base_quant: nf4 needs torchao (the 'quant' extra)")

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config  # noqa: E402
from hybridtrain.peft.lora import apply_lora, lora_state_dict, merge_lora, merged_state_dict  # noqa: E402
from hybridtrain.peft.lora import dense_shapes, dequantized  # noqa: E402
from hybridtrain.peft.quant import is_nf4, scaler_block, splits  # noqa: E402


def qlora_config(**kw):
    """A tiny mixed model whose projections fit NF4's blocks but the Mamba in_proj's (2 x 96 +
    2 x 2 x 16 + 6 = 262 rows x 128 = 524 blocks of 64: not a multiple of 8 block scales, so it
    stays unquantised)."""
    return tiny_config("mixed", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                       moe_shared_expert_intermediate_size=128, mamba_num_heads=6, **kw)


def _pair(seed=0, **cfg):
    torch.manual_seed(seed)
    base = NemotronHForCausalLM(qlora_config(**cfg))
    q, ref = base, copy.deepcopy(base)
    apply_lora(q, match_all_linear=True, base_quant="nf4")
    apply_lora(ref, match_all_linear=True)
    with torch.no_grad():  # the reference: LoRA on the dequantised base, the same adapters
        sd = dequantized(q, q.state_dict())
        ref.load_state_dict({k: v for k, v in sd.items()}, strict=True)
        for k, v in lora_state_dict(ref).items():
            v.copy_(torch.randn_like(v) * 0.05)
        for k, v in lora_state_dict(q).items():
            v.copy_(lora_state_dict(ref)[k])
    return q, ref


def test_scaler_block():
    assert scaler_block(64 * 256 * 8) == 256 and scaler_block(64 * 24) == 8
    assert scaler_block(64 * 256 * 3) == 32  # 24 scale blocks: FSDP2 splits them over 8 ranks
    assert scaler_block(64 * 256 * 6, experts=3) == 64 and scaler_block(64 * 512 * 8, experts=8) == 256
    assert scaler_block(64 * 3) is None and scaler_block(100) is None
    assert splits(64 * 16, rows=4, sbs=8, shards=2) and not splits(64 * 16, rows=3, sbs=8, shards=2)


def test_which_weights_are_nf4_and_the_log(caplog):
    """Every linear layer and expert LoRA could adapt, adapted or not (o_proj and the routed
    experts left out of LoRA here); not the router, norms, conv, embeddings, lm_head, nor a
    weight too small for the scale blocks."""
    torch.manual_seed(0)
    m = NemotronHForCausalLM(qlora_config())
    with caplog.at_level(logging.INFO, logger="hybridtrain.peft.quant"):
        apply_lora(m, match_all_linear=True, exclude_modules=["*.o_proj", "*.experts.*"],
                   base_quant="nf4")
    nf4 = {n for n, p in m.named_parameters() if is_nf4(p)}
    leaves = {n.replace(".weight", "").rsplit(".", 1)[-1] for n in nf4}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "out_proj"}
    assert "backbone.layers.3.mixer.experts.up_proj" in nf4  # routed experts, without adapters
    assert not any("experts.up_proj_lora" in n for n, _ in m.named_parameters())
    assert "backbone.layers.3.mixer.shared_experts.down_proj.weight" in nf4
    assert not any(n.endswith(("in_proj.weight", "gate.weight", "norm.weight",
                               "conv1d.weight", "embeddings.weight", "lm_head.weight")) for n in nf4)
    assert all(not p.requires_grad for n, p in m.named_parameters() if n in nf4)
    msg = next(r.getMessage() for r in caplog.records if "base_quant nf4" in r.getMessage())
    assert f"{len(nf4)} base weights in NF4" in msg and "in_proj.weight (33536 weights" in msg
    ids = torch.randint(0, 256, (1, 12))
    m(ids, labels=ids).backward()  # the experts without adapters compute from NF4
    # 4-bit codes + scales: a quarter of bf16, an eighth of fp32
    w = m.get_submodule("backbone.layers.3.mixer.experts").up_proj
    held = sum(getattr(w, a).numel() * getattr(w, a).element_size()
               for a in ("quantized_data", "quantized_scalers", "quantization_factor"))
    assert held < w.numel() * 4 / 7
    assert dense_shapes(m)["backbone.layers.3.mixer.experts.up_proj"] == (8, 64, 128)


@pytest.mark.parametrize("latent", [None, 64])
def test_qlora_computes_as_lora_on_the_dequantised_base(latent):
    """Loss and adapter gradients equal LoRA's on the dequantised weights (plain and LatentMoE
    experts), and an expert without tokens is never dequantised."""
    q, ref = _pair(moe_latent_size=latent)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (q, ref):
        loss = m(ids, labels=ids)
        loss = loss.loss if hasattr(loss, "loss") else loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    gq = {n: p.grad for n, p in q.named_parameters() if p.requires_grad}
    gr = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert gq.keys() == gr.keys() and any("experts.up_proj_lora_A" in n for n in gq)
    for n in gq:
        torch.testing.assert_close(gq[n], gr[n], rtol=1e-5, atol=1e-6, msg=n)


def test_experts_without_tokens_stay_packed(monkeypatch):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    q, _ = _pair()
    experts = q.get_submodule("backbone.layers.3.mixer.experts")
    rows = []
    real = NF4Tensor.get_original_weight
    monkeypatch.setattr(NF4Tensor, "get_original_weight",
                        lambda self: rows.append(self.shape[0]) or real(self))
    x = torch.randn(5, 128)
    counts = torch.tensor([3, 0, 0, 2, 0, 0, 0, 0])
    with torch.no_grad():
        y = experts(x, counts)
    assert y.shape == (5, 128) and rows == [64, 128] * 2  # up and down of experts 0 and 3 only


def test_merge_dequantises():
    q, ref = _pair()
    want = merged_state_dict(ref)
    got = merged_state_dict(q)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)
    merge_lora(q)
    assert not dense_shapes(q)
    sd = q.state_dict()
    for k in want:
        torch.testing.assert_close(sd[k], want[k], msg=k)


def test_without_torchao_the_refusal_says_how(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torchao(name, *a, **k):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    monkeypatch.setattr("importlib.import_module", lambda name: no_torchao(name))
    m = NemotronHForCausalLM(qlora_config())
    with pytest.raises(ValueError, match=r"hybridtrain\[quant\]"):
        apply_lora(m, match_all_linear=True, base_quant="nf4")


def test_meta_nf4_is_what_to_nf4_makes_on_meta():
    from torchao.quantization import to_nf4

    from hybridtrain.peft.quant import _meta_nf4, require_torchao

    w = torch.empty(96, 128, dtype=torch.bfloat16, device="meta")
    want, got = to_nf4(w, 64, 32), _meta_nf4(require_torchao(), w, 32)
    assert type(got) is type(want) and got.shape == want.shape and got.dtype == want.dtype
    for a in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"):
        x, y = getattr(got, a), getattr(want, a)
        assert (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device), a
    assert (got.block_size, got.n_blocks, got.scaler_block_size) == (64, 192, 32)


@pytest.mark.parametrize("shape,scaler_block,chunk", [
    ((192, 200), 8, 1000),  # rows of 200: chunks of 8 rows (whole 64-weight blocks)
    ((4, 40, 96), 16, 512),  # stacked experts: one expert at a time, chunks of 2 rows
    ((512, 384), 256, 2**17),
])
def test_quantize_rows_is_to_nf4_bit_for_bit(shape, scaler_block, chunk):
    """Quantising a weight in row chunks (NF4 codes per chunk, the double quantisation's
    tensor-wide mean at the end) makes the NF4 tensor ``to_nf4`` makes of the whole."""
    from torchao.quantization import to_nf4

    from hybridtrain.peft.quant import quantize_rows, row_chunks

    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    flat = (w.numel() // shape[-1], shape[-1])
    regions = list(row_chunks(shape, chunk))
    assert len(regions) > 1 and all(w[r].numel() % 64 == 0 for r in regions)
    got = quantize_rows((w[r] for r in regions), w.numel(), flat, scaler_block, torch.bfloat16,
                        torch.device("cpu"))
    want = to_nf4(w.reshape(flat), 64, scaler_block)
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert (got.block_size, got.n_blocks, got.scaler_block_size) == (64, w.numel() // 64, scaler_block)
    for a in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"):
        x, y = getattr(got, a), getattr(want, a)
        assert x.dtype == y.dtype and torch.equal(x, y), a


def test_plan_counts_the_nf4_base():
    """Parameters (NF4 codes and scales, the unquantised rest, fp32 adapters), gradients and
    AdamW state at a real optimizer step equal the plan's within 10 %."""
    from hybridtrain.training.memory_plan import plan_memory
    from tests.helpers import parity as pu
    from tests.helpers.memory import assert_close_10pct, held_at_optimizer_step, planned_bytes

    model = {"config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed",
                        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
                        "moe_shared_expert_intermediate_size": 128}}
    peft = {"dim": 4, "alpha": 8, "match_all_linear": True}
    lora = plan_memory(pu.recipe({}, False, peft=peft, model=model), 1, device_type="cpu")
    peft["base_quant"] = "nf4"
    b, trainer = pu.build({}, 1, peft=peft, model=model)
    got = held_at_optimizer_step(b, trainer)
    plan = plan_memory(pu.recipe({}, False, peft=peft, model=model), 1, device_type="cpu")
    print(got, planned_bytes(plan, 0), lora.ranks[0].params)
    assert_close_10pct(got, planned_bytes(plan, 0), "QLoRA")
    assert plan.ranks[0].params < 0.6 * lora.ranks[0].params  # the tiny model's fp32 embeddings stay
    # a block's working set holds its dequantised weight
    assert plan.ranks[0].activations > lora.ranks[0].activations


def test_nemotron3_nano_qlora_plans_for_one_24gb_card(monkeypatch):
    """The one-GPU recipe's plan at 2048 tokens fits a 24 GB card's 22 GiB (at 4096 tokens, 32 GB:
    tests/unit/test_plan.py plans every shipped recipe on the GPU its header names)."""
    from pathlib import Path

    from hybridtrain.config import load_config
    from hybridtrain.config.loader import parse_overrides
    from hybridtrain.training.memory_plan import plan_memory

    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("NEMOTRON3_NANO_DIR", str(root / "examples/configs/nemotron3_nano_30b_a3b"))
    cfg = load_config(root / "examples/nemotron3_nano_qlora.yaml", parse_overrides(
        ["--dataset.seq_length=2048", "--packing.pack_size=2048"]))
    plan = plan_memory(cfg, 1, device_memory=24 * 2**30)
    assert plan.peak <= 22 * 2**30, plan.peak / 2**30
    assert 15 * 2**30 < plan.ranks[0].params < 18 * 2**30  # bf16 would be 59 GiB


@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}, {"pp": 2}])
def test_layouts_that_split_an_nf4_base_are_refused(layout):
    """Plan and run refuse alike (training/validate.py), naming the key and the fix."""
    from hybridtrain.training.memory_plan import plan_memory
    from tests.helpers import parity as pu

    peft = {"dim": 4, "alpha": 8, "match_all_linear": True, "base_quant": "nf4"}
    key = next(iter(layout))
    with pytest.raises(ValueError, match=rf"peft.base_quant: nf4 .* distributed.{key}=2"):
        plan_memory(pu.recipe(layout, False, peft=peft), 2, device_type="cpu")
