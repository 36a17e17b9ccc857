"""Per-step loss and gradient norm of the runs of scripts/cli_parity_runs.sh in two output folders:
how many values are bit-identical and the largest relative difference.

    python scripts/compare_runs.py BEFORE_DIR AFTER_DIR
"""

import json
import os
import sys

RUNS = ("demo", "pp2ep2", "hsdp", "ipp2", "lora")


def records(folder: str, name: str) -> list[dict]:
    with open(os.path.join(folder, name, "training.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(before: str, after: str) -> float:
    worst = 0.0
    for name in RUNS:
        try:
            a, b = records(before, name), records(after, name)
        except FileNotFoundError as e:
            print(f"{name}: missing ({e.filename})")
            continue
        pairs = [(x[k], y[k]) for x, y in zip(a, b) for k in ("loss", "grad_norm")]
        same = sum(x == y for x, y in pairs)
        rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in pairs)
        worst = max(worst, rel)
        print(f"{name}: {len(a)} / {len(b)} steps, bit-identical {same}/{len(pairs)}, "
              f"max relative difference {rel:.2e}")
    print(f"worst {worst:.2e}")
    return worst


if __name__ == "__main__":
    main(*sys.argv[1:3])
