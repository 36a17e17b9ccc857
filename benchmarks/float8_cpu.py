"""``training.float8`` against bf16 on the CPU: the README's tiny SQuAD run, 40 steps each.

    python benchmarks/float8_cpu.py [--steps 40] [--out /tmp/float8_cpu]

Runs ``examples/squad_tiny.yaml`` (without its evaluation section) in bf16, then with ``training.float8: tensorwise`` and
``rowwise`` (torchao's emulation on a CPU: operands rounded to float8, GEMMs in high precision),
one process each, from the same seed and batches; prints each final training loss and its
distance from bf16's (the target: within 5 %). A CPU says nothing about float8 speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def final_loss(out: Path, float8: str | None, steps: int) -> float:
    run = out / (float8 or "bf16")
    cmd = [sys.executable, "-m", "hybridtrain", "finetune", "-c", str(ROOT / "examples/squad_tiny.yaml"),
           f"--training.max_steps={steps}", "--training.dtype=bf16", f"--checkpoint.dir={run}",
           "--checkpoint.enabled=false", "--training.val_every_steps=0",
           "--evaluation=null", f"--training.float8={float8 or 'null'}"]
    subprocess.run(cmd, check=True, cwd=out, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in open(run / "training.jsonl")]
    return records[-1]["loss"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="/tmp/float8_cpu")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = final_loss(out, None, a.steps)
    print(f"bf16        final loss {base:.4f}")
    for recipe in ("tensorwise", "rowwise"):
        loss = final_loss(out, recipe, a.steps)
        print(f"{recipe:<11} final loss {loss:.4f}  ({(loss - base) / base:+.2%} vs bf16)")


if __name__ == "__main__":
    main()
