"""LoRA under tensor parallelism (2 gloo ranks; and with sequence parallelism and FSDP2, 4 ranks), through the recipe's
builder and trainer, against the single-process run: per-step losses and gradient norms, the
trained adapters, the PEFT export (Mamba ``in_proj``'s ``lora_B`` rows back in the Hub's order)
and the merged export. Adapters on every linear but the LM head and on the MoE experts of the
tiny mixed model (Mamba, attention, MLP, MoE)."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed

LORA = {"dim": 4, "alpha": 8, "match_all_linear": True}


@torch.no_grad()
def _perturb_lora_b(model):
    """Non-zero ``lora_B`` (0 at init), the same full tensor per name in every layout: each rank
    writes its region of it."""
    from hybridtrain.distributed.materialize import local_region
    from hybridtrain.distributed.utils import local_tensor

    for n, p in model.named_parameters():
        if "lora_B" in n:
            g = torch.Generator().manual_seed(zlib.crc32(n.encode()))
            full = torch.randn(p.shape, generator=g) * 0.05
            local_tensor(p).copy_(full[local_region(p)])


def _run(layout, world, packed, out_dir=None):
    """(losses, gradient norms, full adapters) of the LoRA recipe under ``layout``; with
    ``out_dir`` also its PEFT export (``adapter/``) and merged export (``merged/``) of the
    adapters before training (the same tensors in every layout: the exports compare exactly)."""
    from hybridtrain.peft import export_peft
    from hybridtrain.peft.export import save_merged_hf

    b, trainer = pu.build(layout, world, packed, peft=LORA)
    _perturb_lora_b(b.model)
    if out_dir is not None:
        export_peft(b.model, f"{out_dir}/adapter")
        save_merged_hf(b.model, f"{out_dir}/merged")
    losses, norms = pu.train(b, trainer)
    adapters = {n: t for n, t in pu.full_state(b.model).items() if "lora_" in n}
    return losses, norms, adapters, _placements(b.model)


def _placements(model) -> dict:
    """{adapter name: its placements over the tp mesh} of the first Mamba / attention layers,
    and whether the model runs sequence parallel."""
    out = {"sequence_parallel": model.sequence_parallel is not None}
    for n, p in model.named_parameters():
        if "lora_" in n and n.startswith(("backbone.layers.0.", "backbone.layers.1.")):
            out[n.split("mixer.", 1)[1]] = str(p.placements[-1]) if hasattr(p, "placements") else "plain"
    return out


def _tp_worker(rank, world, out_dir):
    return _run({"tp": 2}, world, False, out_dir)


def _tp_fsdp_worker(rank, world):
    return _run({"tp": 2, "dp_shard": 2, "sp": True}, world, True)


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _check(name, got, ref):
    losses, norms, adapters, _ = got
    ref_losses, ref_norms, ref_adapters, _ = ref
    rel, rel_norm = _max_rel(losses, ref_losses), _max_rel(norms, ref_norms)
    assert set(adapters) == set(ref_adapters)
    dw = max(float((adapters[k] - t).norm() / t.norm()) for k, t in ref_adapters.items())
    print(f"{name:18s} loss rel {rel:.2e} grad-norm rel {rel_norm:.2e} adapters rel {dw:.2e}")
    assert rel <= 1e-5, (losses, ref_losses)
    assert rel_norm <= 1e-5, (norms, ref_norms)
    assert dw <= 1e-5


def _load_dir(path):
    from safetensors.torch import load_file

    from pathlib import Path

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.distributed
def test_lora_tp2_matches_single_process(tmp_path):
    import json

    torch.set_num_threads(1)
    ref = _run({}, 1, False, str(tmp_path / "ref"))
    res = run_distributed(_tp_worker, 2, str(tmp_path / "tp2"))
    # split with their base: column-wise in_proj / q_proj, row-wise out_proj / o_proj
    assert {k: v for k, v in res[0][3].items() if "lora_" in k} == {
        "in_proj.lora_A": "R", "in_proj.lora_B": "S(0)",
        "out_proj.lora_A": "S(1)", "out_proj.lora_B": "R",
        "q_proj.lora_A": "R", "q_proj.lora_B": "S(0)",
        "k_proj.lora_A": "R", "k_proj.lora_B": "S(0)",
        "v_proj.lora_A": "R", "v_proj.lora_B": "S(0)",
        "o_proj.lora_A": "S(1)", "o_proj.lora_B": "R"}, res[0][3]
    for r, got in enumerate(res):
        _check(f"lora tp2 r{r}", got, ref)
    # the exports: the adapter bit for bit as one process writes it (Hub row order), the merged
    # model too
    for sub in ("adapter", "merged"):
        got, want = _load_dir(tmp_path / "tp2" / sub), _load_dir(tmp_path / "ref" / sub)
        assert set(got) == set(want) and want, sub
        for k, t in want.items():
            assert torch.equal(got[k], t), (sub, k)
    assert json.loads((tmp_path / "tp2" / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((tmp_path / "ref" / "adapter" / "adapter_config.json").read_text())


@pytest.mark.distributed
def test_lora_tp2_sp_fsdp2_packed_matches_single_process():
    torch.set_num_threads(1)
    ref = _run({}, 1, True)
    res = run_distributed(_tp_fsdp_worker, 4)
    for r in range(4):
        assert res[r][3]["sequence_parallel"]
        _check(f"lora tp2+sp x fsdp2 r{r}", res[r], ref)
