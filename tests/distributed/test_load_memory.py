"""Per-rank peak memory while loading LoRA on a bf16 Hub checkpoint (~0.31 GB, several files)
on 4 gloo ranks: a rank reads and holds its share, not the model (FSDP2 x4: a quarter of it;
PP=2 x EP=2: its stage's half of the dense weights and a quarter of the experts); under FSDP2 x4
two training steps add FSDP2's working set (bounded at 0.7x here); rank 0's peak during the
merged HF export is one output file plus a few full tensors, not the model.
(The 1.7 GB figures: benchmarks/load_memory.py.)

The ranks run with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``) and
``training.cpu_allocator: system``, so every block of 64 KiB or more is its own mapping, given
back when freed. Loading and training are measured in what the rank allocates: glibc's peak of
such blocks above those alive before the build (``tests.helpers.memory.malloc_mmap_peak``),
which no machine setting moves. Resident memory (VmHWM) also counts what the machine decides --
transparent huge pages, file pages mapped in (page cache, shared libraries), blocks under 64 KiB
kept in malloc's arenas -- and measured 0.28x on one 2-core machine, 0.63x (rank 0) on another,
for the same load; the export's peak, bounded with room, still uses it."""

import os

import pytest

from tests.helpers import memory as mem
from tests.helpers.distributed import run_distributed

SHARD = 50 * 10**6
PATTERN = "MEE" * 3 + "*EE"  # 12 layers, 8 of them MoE of 16 experts
STEPS = 2  # the optimizer state exists from the second step on


def _peaks(layout, world, tiny, big, out, steps):
    """(bytes allocated at the big build's peak above those before it, the same up to the end
    of training above the tiny run's (``steps`` > 0), the resident export peak above the RSS
    before it, the largest full tensor's fp32 bytes) of this rank."""
    import gc

    from hybridtrain.distributed.full_tensors import global_layout
    from hybridtrain.peft.export import save_merged_hf
    from hybridtrain.training.builder import build

    rank = int(os.environ.get("RANK", 0))

    def run(ckpt):
        """(model, bytes allocated at the build's peak, at the peak up to the end of training)
        above those alive before the build; glibc keeps one peak for the process's life, so a
        peak not above the one before is unknown: 0 (the tiny run's, subtracted: on the safe
        side), or that earlier peak (the big run's: an over-count, also on the safe side)."""
        gc.collect()  # the previous build
        before, peak_before = mem.malloc_mmapped(), mem.malloc_mmap_peak()
        b = build(mem.lora_recipe(layout, ckpt, max_steps=max(steps, 1)), "cpu",
                  is_main=rank == 0, world_size=world, data=steps > 0)
        loaded = mem.malloc_mmap_peak()
        if steps:
            mem.train(b, steps)
        trained = mem.malloc_mmap_peak()
        if ckpt == tiny:
            return None, 0, (trained - before if trained > peak_before else 0)
        return b, loaded - before, trained - before

    _, _, train0 = run(tiny)  # imports, data and caches exist for the big run then
    b, load, train = run(big)
    largest = max(t.numel() * 4 for t in global_layout(b.model).values())
    mem.reset_peak()
    before = mem.status("VmRSS")
    save_merged_hf(b.model, out, max_shard_size=SHARD)
    return (load, train - train0 if steps else None, mem.status("VmHWM") - before, largest)


LAYOUTS = {"fsdp2x4": ({"dp_shard": 4}, STEPS), "pp2xep2": ({"pp": 2, "ep": 2}, 0)}


def _worker(rank, world, layout, steps, tiny, big, out):
    return _peaks(layout, world, tiny, big, out, steps)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny and the ~0.31 GB checkpoint (several files + index), written once."""
    root = tmp_path_factory.mktemp("load_memory")
    tiny, big = str(root / "tiny"), str(root / "big")
    mem.write_checkpoint(tiny, mem.config(None, PATTERN))
    size = mem.write_checkpoint(big, mem.config(640, PATTERN), max_shard_size="100MB")
    assert 0.25e9 < size < 0.4e9 and len(os.listdir(big)) > 3
    return tiny, big, size


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rank_loads_and_exports_its_share(name, checkpoints, tmp_path, monkeypatch):
    tiny, big, size = checkpoints
    layout, steps = LAYOUTS[name]
    if not mem.glibc_malloc():
        pytest.skip("measures glibc's malloc (mallinfo2, malloc_stats): not this C library")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks' glibc reads it at start
    res = run_distributed(_worker, 4, layout, steps, tiny, big, str(tmp_path / "out"), timeout=600)
    print(name, [(round(r[0] / size, 3), r[1] and round(r[1] / size, 3)) for r in res],
          round(res[0][2] / 1e6))
    for rank, (load, train, export, largest) in enumerate(res):
        assert load <= 0.4 * size, (name, rank, load / size)
        # loading measured 0.29x (2026-11-26), training above the tiny run's 0.53-0.59x (the
        # working set above the 0.25x share does not shrink with the model: the 32k head is
        # 13 % of it; at 1.7 GB: 0.38x)
        assert train is None or train <= 0.7 * size, (name, rank, train / size)
        if rank == 0:  # one output file, the weight in flight and its fp32 merge
            assert export <= SHARD + 4 * largest, (name, export, largest)


def _fsdp_peak_worker(rank, world, layout, tiny, big):
    """(peak RssAnon of the big run, of the tiny run) of this rank: build + 2 training steps."""
    import gc

    from hybridtrain.training.builder import build

    peaks = {}
    with mem.RssAnonSampler() as sampler:
        for name, ckpt in (("tiny", tiny), ("big", big)):
            gc.collect()
            sampler.reset()
            b = build(mem.lora_recipe(layout, ckpt, max_steps=STEPS), "cpu", is_main=rank == 0,
                      world_size=world)
            mem.train(b, STEPS)
            del b
            peaks[name] = sampler.reset()
    return peaks["big"], peaks["tiny"]


@pytest.mark.distributed
def test_no_rank_holds_more_than_fsdp_needs(checkpoints, monkeypatch):
    """LoRA under FSDP2 x4, bf16, two steps: each rank's peak anonymous memory (RssAnon sampled
    every 5 ms) above the same run on the tiny checkpoint is within 0.1x the checkpoint of the
    floor FSDP2 needs, as the plan names it: the rank's share (parameters) plus two gathered units
    of the largest kind (FSDP gathered parameters). The frozen embeddings are not gathered in
    backward (fsdp.no_prefetch_of_units_without_backward) and gloo's all-gather needs no second
    copy of the unit (fsdp.InPlaceAllGather): before those, 0.74x (step 1) and 0.85-0.90x (step
    2) here, on a floor of 0.50x.

    glibc's mmap threshold is fixed (``MALLOC_MMAP_THRESHOLD_``): with its dynamic threshold
    glibc keeps freed blocks of up to 32 MiB in the heap, and the same run peaks at 1.7-2.6x.
    oneDNN runs the bf16 GEMMs as a user's run does: ``build`` bounds its per-shape kernel
    caches (ops/backend.py, plan's ``cpu_gemm_kernels``), which both runs fill, so the big run
    holds no more of them than the tiny one (measured 2026-11-28: 0.56-0.57x on a floor of
    0.51x; with torch's default of 1024 kernels per cache, 0.78-0.80x)."""
    from hybridtrain.recipes.memory_plan import plan_memory

    tiny, big, size = checkpoints
    if not mem.glibc_malloc():
        pytest.skip("fixes glibc's mmap threshold: not this C library")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    layout = {"dp_shard": 4}
    plan = plan_memory(mem.lora_recipe(layout, big), 4, device_type="cpu")
    res = run_distributed(_fsdp_peak_worker, 4, layout, tiny, big, timeout=600)
    for rank, (peak, tiny_peak) in enumerate(res):
        r = plan.ranks[rank]
        floor = r.params + r.buffers["fsdp_gathered_params"]
        print(rank, f"peak {(peak - tiny_peak) / size:.3f}x, floor {floor / size:.3f}x")
        assert peak - tiny_peak <= floor + 0.1 * size, (rank, (peak - tiny_peak) / size,
                                                         floor / size)
