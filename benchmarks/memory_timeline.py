"""Memory timeline of LoRA training on 4 gloo CPU ranks: each rank's VmRSS / VmHWM at every
FSDP2 unit's forward (before and after), at every unit output's backward and around the
optimizer step, with the units gathered at that point; prints the points where a rank's peak
rose and the peak's neighbourhood (README: "Where FSDP2 × 4's training peak goes").

    PYTHONPATH=src python benchmarks/memory_timeline.py CHECKPOINT_DIR [--layout "{'dp_shard': 4}"]

CHECKPOINT_DIR: a bf16 checkpoint written by ``benchmarks/load_memory.py`` (its ``--dir``).
The recipe is the benchmark's (tests/helpers/memory.py ``lora_recipe``, 2 steps); MB above
the rank's state after loading, as resident memory (rss, its peak) and as bytes allocated
(glibc's mmapped blocks, which hold every block of 64 KiB or more under the fixed mmap
threshold: ``alloc`` now, ``alloc peak`` their peak so far; what the tests bound, see
tests/helpers/memory.py: resident pages also move with machine settings). A unit counts as gathered while a module of it holds
another parameter than its sharded one.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers import memory as mem  # noqa: E402

STEPS = 2


def _worker(rank: int, world: int, ckpt: str, layout: dict) -> list[tuple]:
    from torch.distributed.fsdp import FSDPModule

    from hybridtrain.training.builder import build

    torch.set_num_threads(1)
    b = build(mem.lora_recipe(layout, ckpt, max_steps=STEPS), "cpu", is_main=rank == 0,
              world_size=world)
    units = {n or "<root>": m for n, m in b.model.named_modules() if isinstance(m, FSDPModule)}
    owner = {}  # FSDP unit name -> [(module, parameter name)] of the parameters it shards
    for name, m in b.model.named_modules():
        unit = next(u for u in sorted(units, key=len, reverse=True)
                    if u == "<root>" or name == u or name.startswith(u + "."))
        owner.setdefault(unit, []).extend((m, p) for p, _ in m.named_parameters(recurse=False))
    sharded = {id(p) for p in b.model.parameters()}
    log = []

    def mark(tag):
        gathered = [n for n, ps in owner.items()
                    if any(id(getattr(m, p)) not in sharded for m, p in ps)]
        log.append((tag, mem.status("VmRSS"), mem.status("VmHWM"), gathered, mem.malloc_mmapped(),
                    mem.malloc_mmap_peak()))

    for name, m in units.items():
        m.register_forward_pre_hook(lambda mod, a, n=name: mark("forward " + n))

        def post(mod, a, out, n=name):
            mark("forward done " + n)
            out = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g, n=n: mark("backward " + n))

        m.register_forward_hook(post)
    b.optimizer.register_step_pre_hook(lambda *a: mark("optimizer step"))
    b.optimizer.register_step_post_hook(lambda *a: mark("optimizer step done"))
    mark("loaded")
    mem.train(b, STEPS)
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--layout", default="{'dp_shard': 4}")
    args = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed blocks leave the process
    from tests.helpers.distributed import run_distributed

    res = run_distributed(_worker, 4, args.checkpoint, ast.literal_eval(args.layout),
                          timeout=3600)
    for rank, log in enumerate(res):
        base, alloc_base = log[0][1], log[0][4]
        peak = max(e[2] for e in log)
        at = next(i for i, e in enumerate(log) if e[2] == peak)
        print(f"== rank {rank}: peak {(peak - base) / 1e6:.1f} MB above the loaded state, "
              f"reached before '{log[at][0]}'")
        prev = log[0][2]
        for i, (tag, rss, hwm, gathered, alloc, alloc_peak) in enumerate(log):
            if hwm > prev + 2e6 or abs(i - at) <= 3 or tag.startswith("optimizer"):
                print(f"  {tag:48s} rss {(rss - base) / 1e6:7.1f}  peak {(hwm - base) / 1e6:7.1f}"
                      f"  alloc {(alloc - alloc_base) / 1e6:7.1f}"
                      f"  alloc peak {(alloc_peak - alloc_base) / 1e6:7.1f}"
                      f"  gathered: {', '.join(gathered) or '-'}")
            prev = hwm


if __name__ == "__main__":
    main()
