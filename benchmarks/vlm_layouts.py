"""The tiny VLM recipe colocated (one process; FSDP2 over 4 ranks; pipeline pp=2 on 2 ranks)
against the heterogeneous layout (``encoder_ranks`` 2 + 2 language lanes), in one invocation:
tokens/s (all ranks together, median of the steps after the first), peak RSS per rank, and
the bridge's bytes per step (sent by each rank: embeddings to the lanes, gradients back; each
side reads its own data, so no images cross).

    python benchmarks/vlm_layouts.py [--steps 8]

CPU figures from a shared 2-core machine move a lot between runs: read the ratios.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.helpers import parity, vlm  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402


def _measure(rank: int, world: int, tmp: str, layout: dict, steps: int):
    b, trainer = vlm.build(tmp, layout, world)
    tps = []
    for s in range(steps):
        t0 = time.perf_counter()
        rec = trainer.train_one_step(parity.micro_batches(b, s % parity.STEPS))
        dt = time.perf_counter() - t0
        if s:
            tps.append(rec["num_tokens"] / dt)
    step = b.plan.pipeline
    sent = getattr(step, "bytes_sent", 0) / steps
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return statistics.median(tps), rss, sent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="vlm_bench_")
    vlm.build(tmp)  # data and tokenizer once
    runs = {
        "colocated, 1 process": [_measure(0, 1, tmp, {}, args.steps)],
        "colocated FSDP2, 4 ranks": run_distributed(_measure, 4, tmp, {}, args.steps, timeout=900),
        "colocated pp=2, 2 ranks": run_distributed(_measure, 2, tmp, {"pp": 2}, args.steps,
                                                   timeout=900),
        "hetero 2 encoder + 2 LLM": run_distributed(_measure, 4, tmp, {"encoder_ranks": 2},
                                                    args.steps, timeout=900),
    }
    base = runs["colocated, 1 process"][0][0]
    print(f"{'layout':28s} {'tokens/s':>9s} {'ratio':>6s}  peak RSS per rank (MiB)  "
          "bridge bytes/step per rank")
    for name, ranks in runs.items():
        tps = ranks[0][0]
        print(f"{name:28s} {tps:9.0f} {tps / base:6.2f}  "
              f"{', '.join(f'{r[1]:.0f}' for r in ranks):24s} "
              f"{', '.join(f'{r[2]:.0f}' for r in ranks)}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
