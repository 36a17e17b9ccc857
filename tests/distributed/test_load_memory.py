"""Per-rank peak memory while loading LoRA on a bf16 Hub checkpoint (~0.31 GB, several files)
on 4 gloo ranks: a rank reads and holds its share, not the model (FSDP2 x4: a quarter of it;
PP=2 x EP=2: its stage's half of the dense weights and a quarter of the experts); under FSDP2 x4
two training steps add FSDP2's working set (bounded at 0.7x here); rank 0's peak during the
merged HF export is one output file plus a few full tensors, not the model.
(The 1.7 GB figures: benchmarks/load_memory.py.)

The ranks run with glibc's mmap threshold fixed at 64 KiB from their start
(``tests.helpers.memory.count_every_block``) and ``training.cpu_allocator: system``, so every
block of 64 KiB or more is its own mapping, given back when freed. Loading and training are measured in what the rank allocates: glibc's peak of
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
    """This rank's measurements (bytes) of the tiny run, then the big one (build, and ``steps``
    training steps when > 0), then the big model's merged export: ``load`` and ``train``,
    allocated at the big build's peak above those before it and the same up to the end of
    training above the tiny run's; ``rss`` and ``rss_tiny``, the peak RssAnon of each run
    (sampled every 5 ms); ``export``, the resident export peak above the RSS before it;
    ``largest``, the largest full tensor's fp32 bytes."""
    import gc

    from hybridtrain.distributed.full_tensors import global_layout
    from hybridtrain.peft.export import save_merged_hf
    from hybridtrain.training.builder import build

    rank = int(os.environ.get("RANK", 0))
    mem.count_every_block(64 * 1024)

    def run(ckpt, sampler):
        """(model, bytes allocated at the build's peak, at the peak up to the end of training,
        peak RssAnon) above those alive before the build; glibc keeps one peak for the
        process's life, so a peak not above the one before is unknown: 0 (the tiny run's,
        subtracted: on the safe side), or that earlier peak (the big run's: an over-count,
        also on the safe side)."""
        gc.collect()  # the previous build
        sampler.reset()
        before, peak_before = mem.malloc_mmapped(), mem.malloc_mmap_peak()
        b = build(mem.lora_recipe(layout, ckpt, max_steps=max(steps, 1)), "cpu",
                  is_main=rank == 0, world_size=world, data=steps > 0)
        loaded = mem.malloc_mmap_peak()
        if steps:
            mem.train(b, steps)
        trained, rss = mem.malloc_mmap_peak(), sampler.reset()
        if ckpt == tiny:
            return None, 0, (trained - before if trained > peak_before else 0), rss
        return b, loaded - before, trained - before, rss

    with mem.RssAnonSampler() as sampler:
        _, _, train0, rss_tiny = run(tiny, sampler)  # imports, data and caches exist for the big run then
        b, load, train, rss = run(big, sampler)
    largest = max(t.numel() * 4 for t in global_layout(b.model).values())
    mem.reset_peak()
    before = mem.status("VmRSS")
    save_merged_hf(b.model, out, max_shard_size=SHARD)
    return {"load": load, "train": train - train0 if steps else None, "rss": rss,
            "rss_tiny": rss_tiny, "export": mem.status("VmHWM") - before, "largest": largest}


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


@pytest.fixture(scope="module")
def measured(checkpoints, tmp_path_factory):
    """``measured(name)``: each rank's :func:`_peaks` under layout ``name`` on 4 gloo ranks,
    one run per layout for all the tests that read it."""
    if not mem.glibc_malloc():
        pytest.skip("measures glibc's malloc (mallinfo2, malloc_stats): not this C library")
    tiny, big, _ = checkpoints
    runs = {}

    def get(name):
        if name not in runs:
            layout, steps = LAYOUTS[name]
            runs[name] = run_distributed(_worker, 4, layout, steps, tiny, big,
                                         str(tmp_path_factory.mktemp(name)), timeout=600)
        return runs[name]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rank_loads_and_exports_its_share(name, checkpoints, measured):
    size = checkpoints[2]
    res = measured(name)
    print(name, [(round(r["load"] / size, 3), r["train"] and round(r["train"] / size, 3))
                 for r in res], round(res[0]["export"] / 1e6))
    for rank, r in enumerate(res):
        assert r["load"] <= 0.4 * size, (name, rank, r["load"] / size)
        # loading measured 0.29x (2026-11-26), training above the tiny run's 0.53-0.59x (the
        # working set above the 0.25x share does not shrink with the model: the 32k head is
        # 13 % of it; at 1.7 GB: 0.38x)
        assert r["train"] is None or r["train"] <= 0.7 * size, (name, rank, r["train"] / size)
        if rank == 0:  # one output file, the weight in flight and its fp32 merge
            assert r["export"] <= SHARD + 4 * r["largest"], (name, r["export"], r["largest"])


@pytest.mark.distributed
def test_no_rank_holds_more_than_fsdp_needs(checkpoints, measured):
    """LoRA under FSDP2 x4, bf16, two steps: each rank's peak anonymous memory (RssAnon sampled
    every 5 ms) above the same run on the tiny checkpoint is within 0.1x the checkpoint of the
    floor FSDP2 needs, as the plan names it: the rank's share (parameters) plus two gathered units
    of the largest kind (FSDP gathered parameters). The frozen embeddings are not gathered in
    backward (fsdp.no_prefetch_of_units_without_backward) and gloo's all-gather needs no second
    copy of the unit (fsdp.InPlaceAllGather): before those, 0.74x (step 1) and 0.85-0.90x (step
    2) here, on a floor of 0.50x. (The run of the test above: its build and training.)

    glibc's mmap threshold is fixed (``count_every_block``): with its dynamic threshold
    glibc keeps freed blocks of up to 32 MiB in the heap, and the same run peaks at 1.7-2.6x.
    oneDNN runs the bf16 GEMMs as a user's run does: ``build`` bounds its per-shape kernel
    caches (ops/backend.py, plan's ``cpu_gemm_kernels``), which both runs fill, so the big run
    holds no more of them than the tiny one (measured 2026-11-28: 0.56-0.57x on a floor of
    0.51x; with torch's default of 1024 kernels per cache, 0.78-0.80x)."""
    from hybridtrain.training.memory_plan import plan_memory

    tiny, big, size = checkpoints
    layout, steps = LAYOUTS["fsdp2x4"]
    assert steps == STEPS
    plan = plan_memory(mem.lora_recipe(layout, big), 4, device_type="cpu")
    for rank, r in enumerate(measured("fsdp2x4")):
        p = plan.ranks[rank]
        floor = p.params + p.buffers["fsdp_gathered_params"]
        grown = r["rss"] - r["rss_tiny"]
        print(rank, f"peak {grown / size:.3f}x, floor {floor / size:.3f}x")
        assert grown <= floor + 0.1 * size, (rank, grown / size, floor / size)
