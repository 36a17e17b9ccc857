"""Cost growth: the memory a Mamba layer keeps for backward grows linearly with
the sequence length -- measured exactly, as the bytes autograd saves, not by timing."""

import pytest
import torch

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config


def _saved_bytes(fn, module) -> int:
    """Bytes of the distinct activation tensors autograd saves for backward while ``fn`` runs
    (the module's parameters, also saved by its matmuls, are not activations)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed_documents"])
def test_mamba_layer_activation_memory_is_linear_in_sequence_length(packed):
    torch.manual_seed(0)
    config = tiny_config("dense", chunk_size=16)
    mixer = NemotronHForCausalLM(config).backbone.layers["0"].mixer
    assert config.layers_block_type[0] == "linear_attention"
    per_token = {}
    for L in (256, 1024, 4096):
        x = torch.randn(1, L, config.hidden_size, requires_grad=True)
        seq_idx = (torch.arange(L) // 100).to(torch.int32)[None] if packed else None
        per_token[L] = _saved_bytes(lambda: mixer(x, seq_idx=seq_idx), mixer) / L
    # linear growth = constant bytes per token (a quadratic term would grow 16x from 256 to 4096)
    assert per_token[4096] == pytest.approx(per_token[256], rel=0.05)
    assert per_token[1024] == pytest.approx(per_token[256], rel=0.05)
