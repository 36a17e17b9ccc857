"""``hybridtrain lm-eval MODEL --tasks T[,T...]``: EleutherAI's lm-evaluation-harness on a
hybridtrain model (a Hugging Face folder, a run folder or a step_N checkpoint, with an optional
PEFT adapter), through the lm_eval model ``hybridtrain``
(:mod:`hybridtrain.recipes.lm_harness_model`). Needs the lm_eval extra."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridtrain lm-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL", help="HF folder, run folder or step_N checkpoint")
    p.add_argument("--tasks", required=True, help="lm_eval task names, comma-separated")
    p.add_argument("--include-path", default=None, metavar="DIR",
                   help="a folder of your own task YAMLs (lm_eval's --include_path)")
    p.add_argument("--adapter", default=None, metavar="DIR", help="a PEFT adapter to apply")
    p.add_argument("--dtype", default=None, help="weights' dtype (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together")
    p.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="tokens per packed log-likelihood forward")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction)")
    p.add_argument("--output", default=None, metavar="FILE", help="write the results as JSON")
    return p


def _task_manager(task_manager_cls, include_path: str | None, tasks: list[str]):
    """lm_eval's task index: of ``include_path`` alone when it holds every task (indexing
    lm_eval's thousands of built-in tasks takes seconds), else with the built-in ones."""
    if include_path:
        own = task_manager_cls(include_path=include_path, include_defaults=False)
        if all(t in own.all_tasks for t in tasks):
            return own
    return task_manager_cls(include_path=include_path)


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError as e:
        raise ValueError(f"hybridtrain lm-eval needs lm-evaluation-harness ({e}); "
                         "pip install 'hybridtrain[lm_eval]'") from None
    import hybridtrain.recipes.lm_harness_model  # noqa: F401  (registers the model)

    model_args = {"pretrained": args.model, "adapter": args.adapter, "dtype": args.dtype,
                  "device": args.device, "max_batch_tokens": args.max_batch_tokens}
    tasks = [t for t in args.tasks.split(",") if t]
    manager = _task_manager(TaskManager, args.include_path, tasks)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(missing)} (tasks of your own: "
                         "--include-path DIR with their YAML files)")
    results = lm_eval.simple_evaluate(
        model="hybridtrain", model_args={k: v for k, v in model_args.items() if v is not None},
        tasks=tasks, task_manager=manager, batch_size=args.batch_size,
        num_fewshot=args.num_fewshot, limit=args.limit)
    print(make_table(results))
    if args.output:
        from hybridtrain.fileio import atomic_write

        atomic_write(args.output, json.dumps({k: results[k] for k in ("results", "configs")
                                              if k in results}, indent=2, default=str) + "\n")
        print(f"results in {os.path.abspath(args.output)}", file=sys.stderr)
    return 0
