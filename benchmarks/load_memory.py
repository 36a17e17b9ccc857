"""Per-rank peak host memory of LoRA on a bf16 Hub checkpoint, on 4 gloo CPU ranks: loading
(meta-device build, layout, each rank reads only its slices), training, and rank 0's merged
HF export (streamed, files of 100 MB).

    PYTHONPATH=src python benchmarks/load_memory.py [--hidden 1024] [--layouts fsdp4,pp2ep2]

For each layout it runs the same recipe (tests/helpers/memory.py: LoRA on every linear layer
and expert, bf16 frozen base, bf16 compute, 2 steps) on a checkpoint of 30 layers (20 MoE of 16
experts; hidden 1024: 1.7 GB, 512: 0.45 GB) and on a tiny one of the same layers, and prints
each rank's peak resident memory (VmHWM) above the tiny run's, as a fraction of the checkpoint
size (a rank's share under FSDP x4 is 0.25), and rank 0's peak during the export above its
memory before it. With ``--allocator mmap`` it also prints what the tests bound
(tests/distributed/test_load_memory.py): the bytes allocated at the peak (glibc's peak of
mmapped blocks, ``tests.helpers.memory.malloc_mmap_peak``) of loading above those alive before
the build, and of loading + training above the tiny run's. Resident memory also counts what the
machine decides (transparent huge pages, mapped page cache, small blocks kept in malloc's
arenas): compare the allocated columns across machines.

``--allocator mmap`` (default): ``training.cpu_allocator: system`` with glibc's mmap threshold
fixed at 64 KiB, so freed blocks go back to the system and the peak is what was in use;
``heap``: the CPU default (``auto``), which keeps freed blocks in the process for speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers import memory as mem  # noqa: E402

LAYOUTS = {"fsdp4": {"dp_shard": 4}, "pp2ep2": {"pp": 2, "ep": 2},
           # fsdp_reshard_after_forward: always (each unit also reshards after its backward)
           "pp2ep2_reshard": {"pp": 2, "ep": 2, "reshard": "always"}}
SHARD = 100 * 10**6
STEPS = 2


def _worker(rank: int, world: int, port: int, layout: dict, ckpt: str, out: str,
            allocator: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from hybridtrain.distributed.init import destroy_distributed, init_distributed
    from hybridtrain.peft.export import save_merged_hf
    from hybridtrain.training.builder import build

    init_distributed("cpu", timeout_minutes=30)
    try:
        alloc0, peak0 = mem.malloc_mmapped(), mem.malloc_mmap_peak()
        b = build(mem.lora_recipe(layout, ckpt, allocator, max_steps=STEPS), "cpu",
                  is_main=rank == 0, world_size=world)
        loaded, alloc_loaded = mem.status("VmHWM"), mem.malloc_mmap_peak() - alloc0
        mem.train(b, STEPS)
        trained, alloc_peak = mem.status("VmHWM"), mem.malloc_mmap_peak()
        mem.reset_peak()
        before = mem.status("VmRSS")
        save_merged_hf(b.model, out, max_shard_size=SHARD)
        q.put((rank, loaded, trained, mem.status("VmHWM") - before, alloc_loaded,
               alloc_peak - alloc0, alloc_peak > peak0))
    finally:
        destroy_distributed()


def measure(layout: dict, ckpt: str, out: str, allocator: str, world: int = 4) -> list[tuple]:
    from tests.helpers.distributed import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, layout, ckpt, out, allocator, q))
             for r in range(world)]
    for p in procs:
        p.start()
    res = sorted(q.get() for _ in procs)
    for p in procs:
        p.join()
        assert p.exitcode == 0, p.exitcode
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="fsdp4,pp2ep2")
    ap.add_argument("--hidden", type=int, default=1024, help="1024: ~1.7 GB, 512: ~0.45 GB")
    ap.add_argument("--allocator", default="mmap", choices=("mmap", "heap"))
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: tmp)")
    args = ap.parse_args()
    if args.allocator == "mmap":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the ranks' glibc at start
    root = args.dir or tempfile.mkdtemp(prefix="load_memory_")
    dirs = {False: os.path.join(root, "tiny"), True: os.path.join(root, str(args.hidden))}
    for big, d in dirs.items():
        if not os.path.isdir(d):
            mem.write_checkpoint(d, mem.config(args.hidden if big else None))
    size = mem.checkpoint_bytes(dirs[True])
    print(f"checkpoint: {size / 1e9:.2f} GB bf16 ({mem.PATTERN}, hidden {args.hidden}); "
          f"allocator: {args.allocator}; merged export in files of {SHARD / 1e6:.0f} MB",
          flush=True)
    allocator = "system" if args.allocator == "mmap" else "auto"
    for name in args.layouts.split(","):
        runs = {big: measure(LAYOUTS[name], dirs[big], os.path.join(root, f"merged_{name}_{big}"),
                             allocator) for big in (False, True)}
        mmap = args.allocator == "mmap"
        print(f"\n{name} {LAYOUTS[name]}: per-rank peak, x checkpoint size; resident: above the "
              "tiny run's" + ("; allocated: see the module docstring" if mmap else ""))
        print("rank  resident: load  load+train" + ("  allocated: load  load+train" if mmap else "")
              + "  export: rank 0 peak above its RSS before (GB)")
        for (r, l0, t0, _, _, at0, new0), (_, l1, t1, e1, al1, at1, _) in zip(runs[False],
                                                                               runs[True]):
            # glibc keeps one peak per process: the tiny run's, if not above the one before
            # its build, is unknown and counts 0 (as in tests/distributed/test_load_memory.py)
            at0 = at0 if new0 else 0
            print(f"{r:>4}  {(l1 - l0) / size:14.3f}  {(t1 - t0) / size:10.3f}"
                  + (f"  {al1 / size:15.3f}  {(at1 - at0) / size:10.3f}" if mmap else "")
                  + (f"  {e1 / 1e9:10.3f}" if r == 0 else ""), flush=True)


if __name__ == "__main__":
    main()
