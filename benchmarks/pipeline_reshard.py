"""Step time under PP=2 x EP=2 (4 gloo CPU ranks, fp32) with ``distributed.fsdp_reshard_after_forward``
``default`` (a stage stays gathered through the step) and ``always`` (each FSDP2 unit is
all-gathered again for every micro-batch's forward and backward), in one invocation.

    PYTHONPATH=src python benchmarks/pipeline_reshard.py [--hidden 256] [--seq 128] [--lora]

The model: the layer pattern of ``benchmarks/load_memory.py`` (30 layers, 20 MoE of 16 experts,
vocab 32k) at width ``--hidden``, random weights; ``--micro-batches`` micro-batches of one row of
``--seq`` tokens per step and data-parallel rank. The two policies alternate (``--rounds``
times each); prints each policy's median step time (steps after the first of each build) and
``always / default``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

POLICIES = ("default", "always")


def _recipe(args, policy: str) -> dict:
    from tests.helpers import memory as mem
    from tests.helpers import parity as pu

    gbs = 2 * args.micro_batches  # 4 ranks = pp 2 x dp_shard 2 (ep 2 over dp_shard)
    lora = {"peft": {"dim": 8, "alpha": 16, "match_all_linear": True}} if args.lora else {}
    recipe = pu.recipe({"pp": 2, "ep": 2, "reshard": policy}, False,
                       training={"global_batch_size": gbs, "micro_batch_size": 1,
                                 "max_steps": args.steps}, **lora)
    recipe["dataset"].update(n=gbs * args.steps, min_len=args.seq, max_len=args.seq,
                             vocab_size=32000)
    recipe["model"]["config"].update(kind="moe", **mem.config_overrides(args.hidden))
    return recipe


def _worker(rank: int, world: int, args) -> dict[str, list[float]]:
    from hybridtrain.training.builder import build
    from tests.helpers import memory as mem
    from tests.helpers import parity as pu

    torch.set_num_threads(1)
    out = {p: [] for p in POLICIES}
    for _ in range(args.rounds):
        for policy in POLICIES:
            b = build(_recipe(args, policy), "cpu", is_main=rank == 0, world_size=world)
            trainer = mem.trainer(b, args.steps)
            for step in range(args.steps):
                batches = pu.micro_batches(b, step)
                t0 = time.perf_counter()
                trainer.train_one_step(batches)
                if step:  # the first step of a build warms up
                    out[policy].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lora", action="store_true")
    args = ap.parse_args()
    from tests.helpers.distributed import run_distributed

    res = run_distributed(_worker, 4, args, timeout=3000)
    # a step ends when the slowest rank's does: the max over ranks, step by step
    per_step = {p: [max(r[p][i] for r in res) for i in range(len(res[0][p]))] for p in POLICIES}
    med = {p: statistics.median(v) for p, v in per_step.items()}
    print(f"PP=2 x EP=2, 4 gloo ranks, fp32, hidden {args.hidden}, {args.micro_batches} micro-batches "
          f"of 1 x {args.seq} tokens per rank and step, {'LoRA' if args.lora else 'full SFT'}")
    for p in POLICIES:
        print(f"{p:8s} median step {med[p]:.3f} s over {len(per_step[p])} steps")
    print(f"always / default: {med['always'] / med['default']:.3f}")


if __name__ == "__main__":
    main()
