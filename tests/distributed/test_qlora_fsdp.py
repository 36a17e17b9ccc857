"""QLoRA (``peft.base_quant: nf4``) under FSDP2 (2 gloo ranks, NF4 base weights sharded by rows
as torchtune shards them) equals the single-process run: per-step losses, gradient norms and
the trained adapters."""

import pytest
import torch

pytest.importorskip("torchao", reason="peft.base_quant: nf4 needs torchao (the 'quant' extra)")

from tests.helpers import parity as pu  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

QLORA = {"dim": 4, "alpha": 8, "match_all_linear": True, "base_quant": "nf4"}
MODEL = {"config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed",
                    "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
                    "moe_shared_expert_intermediate_size": 128, "mamba_num_heads": 6}}


def _train(layout, world, out_dir):
    """(losses, gradient norms, trained adapters, NF4 weights); the merged export (the NF4 base
    dequantised, gathered from the shards) written to ``out_dir``."""
    from hybridtrain.peft import lora_state_dict, save_merged_hf
    from hybridtrain.peft.quant import is_nf4

    b, trainer = pu.build(layout, world, peft=QLORA, model=MODEL)
    n_nf4 = sum(is_nf4(p) for p in b.model.parameters())
    losses, norms = pu.train(b, trainer)
    adapters = {n: t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
                for n, t in lora_state_dict(b.model).items()}
    save_merged_hf(b.model, out_dir)
    return losses, norms, adapters, n_nf4


def _worker(rank, world, out_dir):
    return _train({"dp_shard": 2}, world, out_dir)


@pytest.mark.distributed
def test_qlora_fsdp2_matches_single_process(tmp_path):
    from safetensors.torch import load_file

    ref_losses, ref_norms, ref_adapters, n_nf4 = _train({}, 1, str(tmp_path / "ref"))
    assert n_nf4 > 10
    for losses, norms, adapters, n in run_distributed(_worker, 2, str(tmp_path / "fsdp")):
        assert n == n_nf4
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) <= 1e-5, (norms, ref_norms)
        for k, t in ref_adapters.items():
            torch.testing.assert_close(adapters[k], t, rtol=0, atol=1e-5, msg=k)
    got, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("fsdp", "ref"))
    assert got.keys() == want.keys()
    for k, t in want.items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=1e-5, msg=k)
