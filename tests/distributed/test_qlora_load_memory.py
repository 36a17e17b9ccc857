"""QLoRA quantises while it loads: building ``peft.base_quant: nf4`` on a bf16 Hub checkpoint
reads and quantises each weight in row chunks of at most 32K weights (stacked experts one
expert at a time: :func:`hybridtrain.peft.quant.row_chunks`). Its peak is the NF4 model plus
one chunk's working set -- never the bf16 model, nor one whole tensor: at most 0.35x the bf16
load's peak. Both measured in fresh processes (ranks of their own) in what they allocate, as
tests/distributed/test_load_memory.py measures (glibc's peak of blocks of 64 KiB or more)."""

import os

import pytest

pytest.importorskip("torchao", reason="peft.base_quant: nf4 needs torchao (the 'quant' extra)")

from tests.helpers import memory as mem  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

PATTERN = "MEE" * 3 + "*EE"  # 12 layers, 8 of them MoE of 16 experts
HIDDEN = 384  # the stacked experts, [16 x 384, 384], are the largest tensors


def _peak(rank, world, what, ckpt):
    """Bytes allocated at the peak of building the LoRA recipe on the checkpoint (``what``:
    ``nf4`` or ``bf16`` base) in this fresh process, above those alive before it, and what the
    build keeps (``held``)."""
    from hybridtrain.peft.quant import is_nf4
    from hybridtrain.training.builder import build

    mem.count_every_block(64 * 1024)
    before = mem.malloc_mmapped()
    b = build(_recipe(ckpt, what if what == "nf4" else None), "cpu", data=False)
    out = {what: mem.malloc_mmap_peak() - before, f"{what}_held": mem.malloc_mmapped() - before}
    assert any(is_nf4(p) for p in b.model.parameters()) == (what == "nf4")
    return out


def _recipe(ckpt, quant):
    recipe = mem.lora_recipe({}, ckpt)
    recipe["peft"]["base_quant"] = quant
    return recipe


@pytest.mark.distributed
@pytest.mark.slow
def test_nf4_load_peak_is_a_third_of_the_bf16_one(tmp_path):
    if not mem.glibc_malloc():
        pytest.skip("measures glibc's malloc (mallinfo2, malloc_stats): not this C library")
    ckpt = str(tmp_path / "ckpt")
    size = mem.write_checkpoint(ckpt, mem.config(HIDDEN, PATTERN, vocab=2048), max_shard_size="40MB")
    assert len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")]) > 1
    peaks = {}
    for what in ("bf16", "nf4"):
        peaks.update(run_distributed(_peak, 1, what, ckpt, timeout=300)[0])
    print({k: round(v / size, 3) for k, v in peaks.items()}, round(size / 1e6), "MB")
    assert peaks["bf16"] >= 0.9 * size
    assert peaks["nf4"] <= 0.35 * peaks["bf16"], peaks
