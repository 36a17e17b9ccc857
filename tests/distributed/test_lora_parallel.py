"""LoRA under FSDP2 + expert parallelism (2 gloo ranks) equals the single-process run: adapter
gradients (experts' per-expert adapters sharded with the experts) and the PEFT export."""

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _lora_model():
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
    from hybridtrain.peft import apply_lora

    torch.manual_seed(0)
    m = NemotronHForCausalLM(tiny_config("moe"))
    apply_lora(m, dim=4, alpha=8, match_all_linear=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = torch.randint(0, 256, (2, 10), generator=g)
    labels = torch.randint(0, 256, (2, 10), generator=g)
    return m, ids, labels


def _reference():
    from hybridtrain.models.nemotron_h.parallelize import full_logits_ce_sum
    from hybridtrain.peft import peft_state_dict

    m, ids, labels = _lora_model()
    full_logits_ce_sum(m.hidden_states(ids), m.lm_head.weight, labels).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    return grads, peft_state_dict(m)


def _worker(rank, world, out_dir):
    from hybridtrain.distributed.parallel_dims import ParallelDims
    from hybridtrain.models.nemotron_h.parallelize import parallelize_nemotron_h
    from hybridtrain.peft import export_peft

    m, ids, labels = _lora_model()
    dims = ParallelDims(world_size=world, ep=2).build_mesh("cpu")
    plan = parallelize_nemotron_h(m, dims, device="cpu")
    plan.stages[0](ids[rank:rank + 1], labels=labels[rank:rank + 1]).backward()
    grads = {}
    for n, p in m.named_parameters():
        if p.requires_grad:
            g = p.grad
            grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g
        else:
            assert p.grad is None, n
    export_peft(m, out_dir)
    return grads


@pytest.mark.distributed
def test_lora_fsdp_ep2_matches_single_process(tmp_path):
    from safetensors.torch import load_file

    ref_grads, ref_tensors = _reference()
    res = run_distributed(_worker, 2, str(tmp_path / "adapter"))
    for r in range(2):
        assert set(res[r]) == set(ref_grads)
        for n, g in ref_grads.items():
            torch.testing.assert_close(res[r][n], g, rtol=1e-5, atol=1e-6, msg=n)
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert set(got) == set(ref_tensors)
    for k, t in ref_tensors.items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=0, msg=k)


def _pp_worker(rank, world, out_dir):
    from hybridtrain.distributed.parallel_dims import ParallelDims
    from hybridtrain.models.nemotron_h.parallelize import parallelize_nemotron_h
    from hybridtrain.peft import export_peft

    m, _, _ = _lora_model()
    dims = ParallelDims(world_size=world, pp=2).build_mesh("cpu")
    parallelize_nemotron_h(m, dims, device="cpu")
    n_layers = len(m.backbone.layers)
    export_peft(m, out_dir, "base")
    return n_layers


@pytest.mark.distributed
def test_lora_export_under_pipeline_parallel(tmp_path):
    """Each pipeline stage holds some layers' adapters; the export holds all of them once."""
    import json

    from safetensors.torch import load_file

    from hybridtrain.peft import save_peft_adapter

    m, _, _ = _lora_model()
    save_peft_adapter(m, tmp_path / "ref", "base")
    layers = run_distributed(_pp_worker, 2, str(tmp_path / "adapter"))
    assert sum(layers) == m.config.num_hidden_layers and min(layers) > 0
    ref, got = load_file(str(tmp_path / "ref" / "adapter_model.safetensors")), \
        load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert set(got) == set(ref)
    for k, t in ref.items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=0, msg=k)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((tmp_path / "ref" / "adapter_config.json").read_text())
