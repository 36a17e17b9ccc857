"""QLoRA quantises while it loads: building ``peft.base_quant: nf4`` on a bf16 Hub checkpoint
reads and quantises one tensor at a time. Its peak is the NF4 model plus one tensor's
quantisation working set -- never the bf16 model: torchao's ``to_nf4`` holds ~72 bytes per
element of its nearest-code search (chunks of 1M elements) and a few copies of the tensor, so on
a model this small (0.09 GB) the working set is most of the load's peak, while the NF4 model
itself is at most 0.35x the bf16 load's peak. Measured in fresh processes (ranks of their own)
in what they allocate, as tests/distributed/test_load_memory.py measures (glibc's peak of blocks
of 64 KiB or more; the smallest measure first: glibc keeps one peak per process)."""

import os

import pytest

pytest.importorskip("torchao", reason="peft.base_quant: nf4 needs torchao (the 'quant' extra)")

from tests.helpers import memory as mem  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

PATTERN = "MEE" * 3 + "*EE"  # 12 layers, 8 of them MoE of 16 experts
HIDDEN = 384  # the stacked experts, [16 x 384, 384], are the largest tensors


def _peak(rank, world, what, ckpt):
    """Bytes allocated at the peak of ``what`` in this fresh process, above those alive before
    it: ``one_tensor`` quantises a tensor of the largest shape alone; ``nf4`` / ``bf16`` build
    the LoRA recipe on the checkpoint (``held``: what the NF4 build keeps)."""
    import torch

    from hybridtrain.peft.quant import is_nf4
    from hybridtrain.training.builder import build

    mem.count_every_block(64 * 1024)
    if what == "one_tensor":
        from torchao.quantization import to_nf4

        w = torch.randn(16 * HIDDEN, HIDDEN, dtype=torch.bfloat16)
        before = mem.malloc_mmapped()
        to_nf4(w, 64, 256)
        return {"one_tensor": mem.malloc_mmap_peak() - before, "largest": w.numel() * 2}
    before = mem.malloc_mmapped()
    b = build(_recipe(ckpt, what if what == "nf4" else None), "cpu", data=False)
    out = {what: mem.malloc_mmap_peak() - before, "held": mem.malloc_mmapped() - before}
    assert any(is_nf4(p) for p in b.model.parameters()) == (what == "nf4")
    return out


def _recipe(ckpt, quant):
    recipe = mem.lora_recipe({}, ckpt)
    recipe["peft"]["base_quant"] = quant
    return recipe


@pytest.mark.distributed
@pytest.mark.slow
def test_nf4_loads_tensor_by_tensor(tmp_path):
    if not mem.glibc_malloc():
        pytest.skip("measures glibc's malloc (mallinfo2, malloc_stats): not this C library")
    ckpt = str(tmp_path / "ckpt")
    size = mem.write_checkpoint(ckpt, mem.config(HIDDEN, PATTERN, vocab=2048), max_shard_size="40MB")
    assert len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")]) > 1
    peaks = {}
    for what in ("one_tensor", "bf16", "nf4"):  # the NF4 build's "held" last
        peaks.update(run_distributed(_peak, 1, what, ckpt, timeout=300)[0])
    print({k: round(v / size, 3) for k, v in peaks.items()}, round(size / 1e6), "MB")
    assert peaks["bf16"] >= 0.9 * size
    assert peaks["held"] <= 0.35 * peaks["bf16"], peaks  # the NF4 model (+ bf16 rest, adapters)
    # its load: that model, one tensor's quantisation, the tensor read (and its experts' Hub
    # tensors, stacked) and what any build allocates beyond the weights (as the bf16 one does):
    # never the bf16 model. Measured 2026-12-06: load 1.44x the checkpoint = 0.35 (NF4 model)
    # + 0.82 (quantising one 2.4M-element tensor) + 0.27; the bf16 load 1.17x.
    extra = peaks["bf16"] - size
    assert peaks["nf4"] <= peaks["held"] + peaks["one_tensor"] + extra + 3 * peaks["largest"], peaks
