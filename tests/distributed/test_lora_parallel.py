"""LoRA under FSDP2 + expert parallelism and under pipeline parallelism (2 gloo ranks), through
the recipe's builder and trainer, equals the single-process run: per-step losses, gradient
norms, adapter weights (experts' per-expert adapters sharded with the experts), the PEFT export."""

import zlib

import pytest
import torch

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed

LORA = {"dim": 4, "alpha": 8, "match_all_linear": True}
MOE = {"config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "moe"}}


def _train(layout, world, out_dir):
    """(losses, gradient norms, full weights) of the LoRA recipe under ``layout``; writes the
    PEFT export of the trained adapters to ``out_dir``."""
    from hybridtrain.peft import export_peft

    b, trainer = pu.build(layout, world, peft=LORA, model=MOE)
    losses, norms = pu.train(b, trainer)
    export_peft(b.model, out_dir)
    return losses, norms, pu.gather_state(b.model), b.model


def _worker(rank, world, out_dir):
    losses, norms, state, _ = _train({"ep": 2}, world, out_dir)
    # FSDP2 gathering one unit at a time in backward computes the same, bit for bit
    again = _train({"ep": 2, "backward_prefetch": False}, world, out_dir + "_no_prefetch")[:2]
    assert again == (losses, norms), (again, losses, norms)
    return losses, norms, state


@pytest.mark.distributed
def test_lora_fsdp_ep2_matches_single_process(tmp_path):
    from safetensors.torch import load_file

    from hybridtrain.peft import peft_state_dict

    ref_losses, ref_norms, ref_state, ref_model = _train({}, 1, str(tmp_path / "ref"))
    trainable = {n for n, p in ref_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    res = run_distributed(_worker, 2, str(tmp_path / "adapter"))
    for r in range(2):
        losses, norms, state = res[r]
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) <= 1e-5, (norms, ref_norms)
        assert set(state) == set(ref_state)
        for n, t in ref_state.items():
            if n in trainable:
                torch.testing.assert_close(state[n], t, rtol=0, atol=1e-5, msg=n)
            else:  # frozen base weights: untouched
                assert torch.equal(state[n], t), n
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    ref = load_file(str(tmp_path / "ref" / "adapter_model.safetensors"))
    assert set(got) == set(ref)
    for k, t in ref.items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=1e-5, msg=k)
    # the export holds exactly the sharded run's adapters
    ref_model.load_state_dict(res[0][2], strict=False)
    for k, t in peft_state_dict(ref_model).items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=0, msg=k)


def _perturb_lora_b(model):
    """Non-zero ``lora_B`` (0 at init), the same per name in every layout."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                g = torch.Generator().manual_seed(zlib.crc32(n.encode()))
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _pp_worker(rank, world, out_dir):
    from hybridtrain.peft import export_peft

    b, _ = pu.build({"pp": 2}, world, peft=LORA, model=MOE)
    _perturb_lora_b(b.model)
    export_peft(b.model, out_dir, "base")
    return len(b.model.backbone.layers)


@pytest.mark.distributed
def test_lora_export_under_pipeline_parallel(tmp_path):
    """Each pipeline stage holds some layers' adapters; the export holds all of them once."""
    import json

    from safetensors.torch import load_file

    from hybridtrain.peft import save_peft_adapter

    b, _ = pu.build({}, 1, peft=LORA, model=MOE)
    _perturb_lora_b(b.model)
    save_peft_adapter(b.model, tmp_path / "ref", "base")
    layers = run_distributed(_pp_worker, 2, str(tmp_path / "adapter"))
    assert sum(layers) == b.model.config.num_hidden_layers and min(layers) > 0
    ref, got = load_file(str(tmp_path / "ref" / "adapter_model.safetensors")), \
        load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert set(got) == set(ref)
    assert any(t.abs().sum() > 0 for k, t in ref.items() if "lora_B" in k)
    for k, t in ref.items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=0, msg=k)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((tmp_path / "ref" / "adapter_config.json").read_text())
