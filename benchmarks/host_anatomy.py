"""The host side of one training step on a CPU: what ``benchmarks/vs_trl.py``'s hybridtrain run
dispatches per step, by phase and by the function that dispatched it.

Builds vs_trl's recipe (its tiny Nemotron-H with LoRA, chat data, 2 x 2 micro-batches, fp32),
runs two warm-up steps, then counts the aten operators one step dispatches (a
``TorchDispatchMode``: every op that reaches a kernel, views included) in four phases:

* forward: the model's forward and loss (``TrainStep.loss_sum``);
* backward: autograd's backward, whatever runs it (C++ formulas and hand-written backwards);
* optimizer + clip: ``torch.optim`` and the gradient norm / clipping;
* trainer: the rest of the step (counts, records, metrics, the expert-load table).

and the host reads (``aten._local_scalar_dense``: ``.item()`` / ``int()`` / ``float()`` of a
tensor; on a GPU each waits for the device). The counts do not depend on the machine's load; the
CPU seconds per step printed last (the process' CPU time, the least of ``--repeats`` steps) do.

    python benchmarks/host_anatomy.py            # unpacked and packed, ~30 s on 2 cores
    python benchmarks/host_anatomy.py --packed   # packed only
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hybridtrain

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402  (the benchmark whose step this is)

# the package's own files (a checkout folder named hybridtrain holds these scripts too)
SRC = os.path.join(os.path.dirname(os.path.abspath(hybridtrain.__file__)), "")


def _phase(frame) -> tuple[str, str]:
    """(phase, innermost hybridtrain function) of an op dispatched outside backward under
    ``frame``."""
    where, phase = None, "trainer"
    while frame is not None:
        fn, name = frame.f_code.co_filename, frame.f_code.co_name
        if where is None and fn.startswith(SRC):
            where = f"{fn[len(SRC):]}:{name}"
        if "torch/optim/" in fn or "clip_grad" in fn or name in ("grad_norm", "clip_grads_with_norm_"):
            phase = "optimizer + clip"
        elif name == "loss_sum" and phase == "trainer":
            phase = "forward"
        frame = frame.f_back
    return phase, where or "?"


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops by (phase, function) and the host reads."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase, where = _phase(sys._getframe(1))
        if torch._C._current_autograd_node() is not None:  # C++ formulas and Python backwards
            phase = "backward"
            where = "(autograd's formulas)" if where.startswith("training/") else where
        self.ops[(phase, where)] += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _trainer(base: Path, out: Path, packed: bool):
    from hybridtrain.config import recipe_config
    from hybridtrain.recipes.finetune import _start

    cfg = recipe_config(vs_trl.recipe(base, out, packed))
    trainer, sched, _, _ = _start(cfg, torch.device("cpu"), True, 1, str(out))
    batches = sched.train_batches(lambda s: trainer.data.make_loader(trainer.data.train, s),
                                  len(trainer.data.train), dp_rank=0)
    return trainer, batches


def anatomy(base: Path, out: Path, packed: bool, repeats: int, top: int) -> None:
    trainer, batches = _trainer(base, out, packed)
    for _ in range(2):  # warm-up
        trainer.step(next(batches))
        trainer.settle()
    with OpCounter() as counter:
        trainer.step(next(batches))
        trainer.settle()
    cpu = []
    for _ in range(repeats):
        t = time.process_time()
        trainer.step(next(batches))
        trainer.settle()
        cpu.append(time.process_time() - t)
    phases = collections.Counter()
    for (phase, _), n in counter.ops.items():
        phases[phase] += n
    print(f"{'packed' if packed else 'unpacked'}: {sum(phases.values())} ops dispatched per step, "
          f"{counter.reads} host reads; CPU {min(cpu) * 1e3:.0f} ms per step (least of {repeats})")
    for phase in ("forward", "backward", "optimizer + clip", "trainer"):
        print(f"  {phase:17s} {phases[phase]:5d}")
    print(f"  the {top} largest by function (phase, innermost hybridtrain function):")
    for (phase, where), n in counter.ops.most_common(top):
        print(f"    {n:5d}  {phase:9s} {where}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packed", action="store_true", help="the packed run only")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps (default 3)")
    ap.add_argument("--top", type=int, default=8, help="functions listed (default 8)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp())
    try:
        vs_trl._prepare(tmp / "base")
        for packed in ((True,) if args.packed else (False, True)):
            anatomy(tmp / "base", tmp / f"run_{int(packed)}", packed, args.repeats, args.top)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
