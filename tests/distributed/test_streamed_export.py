"""HF exports streamed tensor by tensor (``hf/``, ``merged_hf/``) under FSDP2, expert
parallelism and pipeline stages are byte-identical to the one-process export, with one file
or several (an index)."""

import os

import pytest

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed

LAYOUTS = ({"dp_shard": 2}, {"ep": 2}, {"pp": 2})
LORA = {"dim": 4, "alpha": 8, "match_all_linear": True}


def _files(d):
    out = {}
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            out[name] = f.read()
    return out


def _exports(layout, world, out):
    """Writes ``out``/{hf, sharded, merged}: the model's export in bf16, the same in ~20 KB
    files, and a LoRA model's merged export (adapters made non-zero)."""
    import torch
    import torch.distributed as dist

    from hybridtrain.distributed.full_tensors import global_layout, stream_full_tensors
    from hybridtrain.models.spec import model_spec_for
    from hybridtrain.peft.export import save_merged_hf
    from hybridtrain.training.builder import build
    from hybridtrain.training.hf_export import export_hf

    rank = dist.get_rank() if dist.is_initialized() else 0
    b = build(pu.recipe(layout, packed=False), "cpu", is_main=rank == 0, world_size=world,
              data=False)
    export_hf(b.model, os.path.join(out, "hf"), dtype=torch.bfloat16)
    lay = global_layout(b.model)
    stream = stream_full_tensors(b.model, lay)
    if rank == 0:
        model_spec_for(b.model).hf.save(lay, b.model.config, os.path.join(out, "sharded"),
                                        max_shard_size="20KB", tensors=stream)
    for _ in stream:
        pass
    b = build(pu.recipe(layout, packed=False, peft=LORA), "cpu", is_main=rank == 0,
              world_size=world, data=False)
    with torch.no_grad():
        for n, p in b.model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)
    save_merged_hf(b.model, os.path.join(out, "merged"))
    if world > 1:
        dist.barrier()


def _worker(rank, world, out):
    for i, layout in enumerate(LAYOUTS):
        _exports(layout, world, os.path.join(out, str(i)))


@pytest.mark.distributed
def test_streamed_exports_equal_one_process(tmp_path):
    _exports({}, 1, str(tmp_path / "ref"))
    ref = {k: _files(tmp_path / "ref" / k) for k in ("hf", "sharded", "merged")}
    assert "model.safetensors.index.json" in ref["sharded"] and len(ref["sharded"]) > 4
    run_distributed(_worker, 2, str(tmp_path / "got"))
    for i, layout in enumerate(LAYOUTS):
        for k, files in ref.items():
            got = _files(tmp_path / "got" / str(i) / k)
            assert set(got) == set(files), (layout, k)
            for name, data in files.items():
                assert got[name] == data, (layout, k, name)
