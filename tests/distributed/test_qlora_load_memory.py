"""QLoRA quantises while it loads: building ``peft.base_quant: nf4`` on a bf16 Hub checkpoint
reads and quantises one tensor at a time. Its peak is the NF4 model plus one tensor's
quantisation working set -- never the bf16 model: torchao's ``to_nf4`` holds ~72 bytes per
element of its nearest-code search (chunks of 1M elements) and a few copies of the tensor, so on
a model this small (0.09 GB) the working set is most of the load's peak, while the NF4 model
itself is at most 0.35x the bf16 load's peak. Measured in one fresh process (a rank of its own)
in what it allocates, as tests/distributed/test_load_memory.py measures (glibc's peak of blocks
of 64 KiB or more; the smallest measure first: glibc keeps one peak per process)."""

import os

import pytest

pytest.importorskip("torchao", reason="peft.base_quant: nf4 needs torchao (the 'quant' extra)")

from tests.helpers import memory as mem  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

PATTERN = "MEE" * 3 + "*EE"  # 12 layers, 8 of them MoE of 16 experts
HIDDEN = 384  # the stacked experts, [16 x 384, 384], are the largest tensors


def _load_peaks(rank, world, tiny, ckpt):
    """Bytes allocated at the peak of: quantising the largest tensor alone, the NF4 build, the
    bf16 build (each above those alive before it); the NF4 model held after its build."""
    import gc

    import torch
    from torchao.quantization import to_nf4

    from hybridtrain.peft.quant import is_nf4
    from hybridtrain.training.builder import build

    mem.count_every_block(64 * 1024)
    w = torch.randn(16 * HIDDEN, HIDDEN, dtype=torch.bfloat16)
    before = mem.malloc_mmapped()
    q = to_nf4(w, 64, 256)
    peaks = {"one_tensor": mem.malloc_mmap_peak() - before, "largest": w.numel() * 2}
    del w, q
    build(_recipe(tiny, "nf4"), "cpu", data=False)  # imports and caches exist for the runs then
    for quant in ("nf4", None):
        gc.collect()
        before = mem.malloc_mmapped()
        b = build(_recipe(ckpt, quant), "cpu", data=False)
        peaks[quant or "bf16"] = mem.malloc_mmap_peak() - before
        assert any(is_nf4(p) for p in b.model.parameters()) == (quant is not None)
        if quant:
            peaks["held"] = mem.malloc_mmapped() - before
        del b
    return peaks


def _recipe(ckpt, quant):
    recipe = mem.lora_recipe({}, ckpt)
    recipe["peft"]["base_quant"] = quant
    return recipe


@pytest.mark.distributed
def test_nf4_loads_tensor_by_tensor(tmp_path):
    if not mem.glibc_malloc():
        pytest.skip("measures glibc's malloc (mallinfo2, malloc_stats): not this C library")
    ckpt, tiny = str(tmp_path / "ckpt"), str(tmp_path / "tiny")
    mem.write_checkpoint(tiny, mem.config(None, PATTERN))
    size = mem.write_checkpoint(ckpt, mem.config(HIDDEN, PATTERN, vocab=2048), max_shard_size="40MB")
    assert len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")]) > 1
    (peaks,) = run_distributed(_load_peaks, 1, tiny, ckpt, timeout=300)
    print({k: round(v / size, 3) for k, v in peaks.items()}, round(size / 1e6), "MB")
    assert peaks["bf16"] >= 0.9 * size
    assert peaks["held"] <= 0.35 * peaks["bf16"], peaks  # the NF4 model (+ bf16 rest, adapters)
    # its load: that model, one tensor's quantisation and the tensor read (stacked from its
    # experts' Hub tensors), never the bf16 model
    assert peaks["nf4"] <= peaks["held"] + peaks["one_tensor"] + 3 * peaks["largest"], peaks
