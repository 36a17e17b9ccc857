"""One training part of ``benchmarks/gpu_check.sh``: ``hybridtrain benchmark`` run in this process
(the same command line), with what the benchmark itself does not report: when each training step
ended (the first steps compile the blocks and autotune the kernels), the seconds torch.compile
spent (``torch._dynamo``'s own accounting) and its graph counts.

Prints ``REACHED ...`` as each step ends, so a part stopped by its time limit shows how far it
got, and ``PART {json}`` at the end or when the limit's SIGTERM arrives. The Triton autotuning
seconds are in the log (``TRITON_PRINT_AUTOTUNING=1``); ``table.py`` adds them up, those of the
kernels ``PART`` names in ``pre_hook_kernels`` apart: Triton keeps no autotune result on disk for
a config that carries a ``pre_hook`` (mamba_ssm's SSD backward kernels), so every part, a process
of its own, tunes them again in its first step.
Usage: python bench_part.py [hybridtrain benchmark arguments...]"""

import json
import logging
import os
import signal
import sys
import time
import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

T0 = time.perf_counter()
state = {"warmup_start_s": None, "step_end_s": []}


def elapsed() -> float:
    return round(time.perf_counter() - T0, 2)


class _BackendConfigured(logging.Handler):
    """Notes when the benchmark configures the backend: its last step before the timed loop."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("backend:") and not state["step_end_s"]:
            state["warmup_start_s"] = elapsed()


def _step_ended(optimizer, args, kwargs) -> None:
    state["step_end_s"].append(elapsed())
    print(f"REACHED training step {len(state['step_end_s'])} at {elapsed():.1f} s", flush=True)


def pre_hook_kernels() -> list[str]:
    """The autotuned Triton kernels loaded in this process whose configs carry a ``pre_hook``
    (their autotune results are never cached on disk: each process tunes them again)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return []
    names = set()
    with warnings.catch_warnings():  # (a deprecated module attribute warns when looked at)
        warnings.simplefilter("ignore")
        for module in list(sys.modules.values()):
            for obj in list(getattr(module, "__dict__", {}).values()):
                if isinstance(obj, Autotuner) and any(c.pre_hook for c in obj.configs):
                    names.add(obj.base_fn.__name__)
    return sorted(names)


def report(status: str) -> dict:
    """The part's figures so far (``status``: done, timed out, failed)."""
    from torch._dynamo.utils import calculate_time_spent, counters

    ends = state["step_end_s"]
    start = state["warmup_start_s"]
    spent = calculate_time_spent()
    out = {
        "status": status,
        "wall_s": elapsed(),
        "warmup_start_s": start,
        "steps_done": len(ends),
        "step_s": [round(b - a, 3) for a, b in zip([start if start is not None else 0.0] + ends, ends)],
        "compile_s": round(spent.get("entire_frame_compile", 0.0), 2),
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else None,
        "pre_hook_kernels": pre_hook_kernels(),
    }
    print("PART " + json.dumps(out), flush=True)
    return out


def _on_limit(signum, frame) -> None:
    print(f"REACHED the time limit at {elapsed():.1f} s after {len(state['step_end_s'])} training "
          "step(s)", flush=True)
    report("timed out")
    os._exit(124)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _on_limit)
    logging.getLogger("hybridtrain.ops.backend").addHandler(_BackendConfigured())
    register_optimizer_step_post_hook(_step_ended)
    from hybridtrain.cli import main as cli

    try:
        rc = cli(["benchmark", *argv])
    except BaseException:
        report("failed")
        raise
    report("done" if rc == 0 else f"failed (rc {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
