"""``hybridtrain <command>`` (also ``python -m hybridtrain <command>``).

Commands::

    hybridtrain finetune  -c RECIPE.yaml [--section.key=value ...] [--nproc-per-node N]
    hybridtrain benchmark -c RECIPE.yaml [--section.key=value ...] [--nproc-per-node N]
    hybridtrain plan      -c RECIPE.yaml --nproc-per-node N [--device-memory 80GB] [--json]
    hybridtrain dpo       -c RECIPE.yaml [--section.key=value ...] [--nproc-per-node N]
    hybridtrain grpo      -c RECIPE.yaml [--section.key=value ...] [--nproc-per-node N]
    hybridtrain convert   CKPT_DIR OUT_HF_DIR
    hybridtrain merge     ...   (arguments defined by hybridtrain.recipes.merge.run)
    hybridtrain generate  --model DIR (--prompt TEXT | --prompts FILE.jsonl) ...
                                (arguments defined by hybridtrain.recipes.generate.build_parser)
    hybridtrain evaluate  -c RECIPE.yaml [--checkpoint DIR] [--section.key=value ...]

``finetune``/``benchmark``/``evaluate`` load the recipe, apply its ``dist_env`` and the process
defaults (``OMP_WAIT_POLICY=PASSIVE`` on oversubscribed cores, unless set; both before torch
is imported),
then either run in this process (one process, or under an external ``torchrun``) or, with
``--nproc-per-node N`` (N > 1), start N workers of themselves on this node with torchrun's
environment (:mod:`hybridtrain.launch`: signals passed on, the workers' exit status, one
error message).

Exit status: 0 done, 2 a user error (the message says what to change), 3 a run that cannot go
on (e.g. diverged), 75 stopped on a signal or ``training.max_time`` after saving a checkpoint
(run again with ``--checkpoint.resume=auto``), or on a signal before it started (nothing to
save), 130 interrupted (Ctrl-C).
The work itself lives in modules imported lazily:
``hybridtrain.recipes.finetune:run(cfg)`` (``dpo``, ``grpo``: ``recipes.dpo`` / ``recipes.grpo``),
``hybridtrain.recipes.benchmark:run(cfg, args)``,
``hybridtrain.training.checkpoint_reader:convert(ckpt_dir, out_dir)``,
``hybridtrain.recipes.merge:run(argv)``, ``hybridtrain.recipes.generate:run(argv)``,
``hybridtrain.recipes.evaluate:run(cfg, checkpoint)``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import shlex
import sys
import warnings
from typing import Callable, Mapping, Sequence

import hybridtrain
from hybridtrain.config import ConfigError, apply_dist_env, apply_process_defaults, load_config
from hybridtrain.config.dtypes import DTYPE_NAMES
from hybridtrain.config.loader import parse_overrides, split_cli_overrides
from hybridtrain.config.recipe import SECTIONS
from hybridtrain.fileio import given_path, output_folder, write_error
from hybridtrain.launch import first_to_report, launch, worker_argv
from hybridtrain.runfolder import NothingToDo, TrainingStopped
from hybridtrain.training.preemption import (
    DEFAULT_SIGNALS, RESUMABLE_COMMANDS, Preempted, stopping_at_once,
)

__all__ = ["main", "build_parser", "strip_nproc_flag", "under_torchrun", "setup_logging"]

logger = logging.getLogger("hybridtrain.cli")

_NPROC_FLAGS = ("--nproc-per-node", "--nproc_per_node")

_OVERRIDE_HELP = """\
overrides (any number, after or before -c):
  --section.key=VALUE        set a key; VALUE is parsed as YAML:
  --section.key VALUE          5 -> int, 0.1 / 1e-4 -> float, true/false -> bool,
                               null -> None, [1, 2] -> list, anything else -> string
  --section.sub.key=VALUE    nested keys are dotted; list items by index (.0, .1)
  --+section.new_key=VALUE   add a key the recipe does not have (e.g. a model kwarg);
                             without '+' an unknown key is an error with a suggestion
  --allowed_target_prefixes=[mypkg.]
                             allow _target_ callables under mypkg (besides hybridtrain.,
                             torch.nn., torch.optim.; docs/safety.md)
  ${env:VAR} / ${env:VAR,default} in any string value reads the environment.

recipe sections:
""" + "".join(f"  {name:<19}{sec.doc}\n" for name, sec in SECTIONS.items()) + """\
  (every key with its default, range and unit: src/hybridtrain/config/recipe.py, or
   python -m hybridtrain.config.reference [SECTION])

examples:
  hybridtrain finetune -c examples/squad_tiny.yaml --training.max_steps=20
  hybridtrain finetune -c recipe.yaml --nproc-per-node 8 --distributed.tp=2
  torchrun --nproc-per-node 8 -m hybridtrain finetune -c recipe.yaml   # runs in-process

environment (docs/recipes/index.md: Environment variables):
  HYBRIDTRAIN_LOG_LEVEL=DEBUG     log level (rank 0; other ranks log warnings and errors)
  HYBRIDTRAIN_LOG_ALL_RANKS=1     log at that level on every rank
  HYBRIDTRAIN_FILTER_WARNINGS=1   silence Python warnings (shown by default)
  HYBRIDTRAIN_DATA_CACHE=DIR      tokenized-dataset cache of datasets without a cache_dir
"""


# --------------------------------------------------------------------------------------------
# logging
# --------------------------------------------------------------------------------------------
def _rank(environ: Mapping[str, str]) -> int:
    """``RANK`` (torchrun), else ``SLURM_PROCID`` (tasks started by srun), else 0."""
    try:
        return int(environ.get("RANK", environ.get("SLURM_PROCID", "0")) or 0)
    except ValueError:
        return 0


class _StderrHandler(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is when the record is emitted, so a caller
    that redirects stderr around :func:`main` (``contextlib.redirect_stderr``, a test's capture)
    and closes that stream afterwards leaves no handler writing to a closed file."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler's own assignments: stderr is looked up
        pass


def setup_logging(level: str | int | None = None,
                  environ: Mapping[str, str] | None = None) -> None:
    """Rank-aware ``logging`` setup; Python warnings are shown unless
    ``HYBRIDTRAIN_FILTER_WARNINGS=1``."""
    environ = os.environ if environ is None else environ
    rank = _rank(environ)
    level = level or environ.get("HYBRIDTRAIN_LOG_LEVEL", "INFO")
    if rank != 0 and environ.get("HYBRIDTRAIN_LOG_ALL_RANKS") != "1":
        level = "WARNING"
    logging.basicConfig(
        level=level.upper() if isinstance(level, str) else level,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        handlers=[_StderrHandler()],
        force=True,
    )
    logging.captureWarnings(True)
    if environ.get("HYBRIDTRAIN_FILTER_WARNINGS") == "1":
        warnings.filterwarnings("ignore")


# --------------------------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------------------------
def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True inside a process started by torchrun (or any launcher exporting its variables)."""
    environ = os.environ if environ is None else environ
    return all(k in environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def strip_nproc_flag(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc-per-node N`` / ``--nproc-per-node=N`` (either spelling)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in _NPROC_FLAGS:
            i += 2
            continue
        if tok.split("=", 1)[0] in _NPROC_FLAGS:
            i += 1
            continue
        out.append(tok)
        i += 1
    return out


# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------
class CommandUnavailable(RuntimeError):
    pass


def _load_entry(module: str, attr: str, command: str) -> Callable:
    try:
        mod = _import_long_lived(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise CommandUnavailable(
                f"'hybridtrain {command}' is not available in this installation: module "
                f"{module} is missing") from None
        raise
    fn = getattr(mod, attr, None)
    if fn is None:
        raise CommandUnavailable(f"'hybridtrain {command}' is not available in this "
                                 f"installation: {module} has no {attr}()")
    return fn


def _import_long_lived(module: str):
    """Import a command's module (torch, transformers and the rest: ~0.45M objects that live as
    long as the process) without the garbage collector walking them on the way, then move them
    to its permanent generation: the full collections of the import and of the run after it cost
    ~0.8 CPU-seconds a process otherwise (2026-12-06, a 3-step tiny run: 7.3 -> 6.5 s).
    A module imported before (a second command in one process) is simply returned."""
    if module in sys.modules:
        return sys.modules[module]
    enabled = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(module)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _add_recipe_options(p: argparse.ArgumentParser, nproc_help: str | None = None) -> set[str]:
    p.add_argument("-c", "--config", required=True, metavar="RECIPE.yaml",
                   help="the YAML recipe")
    p.add_argument(*_NPROC_FLAGS, dest="nproc_per_node", type=_positive_int, default=None,
                   metavar="N", help=nproc_help or "processes on this node: N > 1 re-launches "
                   "under torchrun --standalone (ignored under an external torchrun)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved recipe (defaults, overrides, env) and exit")
    return {"-c", "--config", *_NPROC_FLAGS, "--print-config", "-h", "--help"}


_RECIPE_COMMANDS = {
    "finetune": "fine-tune a model (full SFT or LoRA) from a YAML recipe",
    "benchmark": "measure tokens/s, TFLOPs and MFU of a recipe's training step",
    "dpo": "Direct Preference Optimization on preference pairs (TRL's JSONL format)",
    "grpo": "GRPO on a verifiable task: rollouts, group-normalised rewards, clipped loss",
    "evaluate": "generate answers for a recipe's validation examples with a checkpoint: "
                "SQuAD exact match / F1, sample replies",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, set[str]]]:
    """The argparse parser and, per recipe command, its option strings (the rest of the
    ``--...`` arguments are overrides)."""
    parser = argparse.ArgumentParser(
        prog="hybridtrain", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="PyTorch-native trainer for hybrid Mamba-Transformer-MoE models "
                    "(Nemotron-H family).",
        epilog="Run 'hybridtrain COMMAND --help' for a command's options.\n\n" + _OVERRIDE_HELP)
    parser.add_argument("--version", action="version",
                        version=f"hybridtrain {hybridtrain.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    known: dict[str, set[str]] = {}
    for name, desc in _RECIPE_COMMANDS.items():
        p = sub.add_parser(name, help=desc, description=desc, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           usage=f"hybridtrain {name} -c RECIPE.yaml [--section.key=VALUE ...] "
                                 f"[--nproc-per-node N] [--print-config]",
                           epilog=_OVERRIDE_HELP)
        known[name] = _add_recipe_options(p)
        if name == "evaluate":
            p.add_argument("--checkpoint", default=None, metavar="DIR",
                           help="HF folder, step_N checkpoint or run folder (default: the "
                                "recipe's checkpoint.dir)")
            known[name].add("--checkpoint")
    desc = ("per-rank memory plan of a recipe's layout (no GPU needed: the model is built on "
            "the meta device); exits 1 when it exceeds --device-memory, saying what to change")
    p = sub.add_parser("plan", help=desc, description=desc, allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="hybridtrain plan -c RECIPE.yaml --nproc-per-node N [--nnodes M] "
                             "[--device-memory 80GB] [--json] [--section.key=VALUE ...]",
                       epilog=_OVERRIDE_HELP)
    known["plan"] = _add_recipe_options(p, "ranks per node the plan is for") | {
        "--nnodes", "--device-memory", "--device-type", "--json"}
    p.add_argument("--nnodes", type=_positive_int, default=1, metavar="M",
                   help="nodes (world size = M x N)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="memory per device, e.g. 80GB (binary units: 80 GiB)")
    p.add_argument("--device-type", default="cuda", choices=("cuda", "cpu"),
                   help="the device the plan is for (training.dtype auto: bf16 on cuda)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p = sub.add_parser("convert", help="export a checkpoint (step_N/ or a run folder's latest) "
                       "to a Hugging Face folder",
                       description="Export a checkpoint to a Hugging Face folder "
                       "(config.json, safetensors, tokenizer; adapter_* for LoRA runs).")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a step_N/ folder or a run folder")
    p.add_argument("out_dir", metavar="OUT_HF_DIR", help="output folder")
    p.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                   help="dtype of the exported weights (default: as trained, float32)")
    sub.add_parser("generate", add_help=False,
                   help="complete prompts with a trained model (see 'hybridtrain generate --help')")
    sub.add_parser("merge", add_help=False,
                   help="merge a LoRA adapter into its base model "
                        "(see 'hybridtrain merge --help')")
    sub.add_parser("lm-eval", add_help=False,
                   help="score a model on lm-evaluation-harness tasks "
                        "(see 'hybridtrain lm-eval --help')")
    sub.add_parser("import-recipe", add_help=False,
                   help="a NeMo Automodel fine-tuning recipe as a hybridtrain recipe "
                        "(see 'hybridtrain import-recipe --help')")
    return parser, known


def _run_recipe(command: str, args: argparse.Namespace, overrides: list[str],
                sub_argv: list[str]) -> int:
    cfg = load_config(args.config, parse_overrides(overrides))
    if command in RESUMABLE_COMMANDS:  # the recipe's signals now, instead of the defaults
        with stopping_at_once(cfg, release=DEFAULT_SIGNALS):
            return _run_loaded(command, args, cfg, sub_argv)
    return _run_loaded(command, args, cfg, sub_argv)


def _run_loaded(command: str, args: argparse.Namespace, cfg, sub_argv: list[str]) -> int:
    apply_dist_env(cfg.dist_env)  # first, before anything imports torch / touches CUDA
    if args.print_config:
        sys.stdout.write(cfg.to_yaml())
        return 0
    nproc = args.nproc_per_node
    if command == "plan":  # arithmetic on the meta device: never launches ranks
        run = _load_entry("hybridtrain.recipes.plan", "run", command)
        return run(cfg, (nproc or 1) * args.nnodes, args.device_memory, args.json,
                   args.device_type)
    # the OpenMP wait policy, unless set: PASSIVE on oversubscribed cores (config/dist_env.py)
    apply_process_defaults(local_processes=nproc or 1)
    if nproc is not None and under_torchrun():
        if nproc != int(os.environ.get("LOCAL_WORLD_SIZE", nproc)):
            logger.warning("--nproc-per-node %d ignored: already running under torchrun with "
                           "LOCAL_WORLD_SIZE=%s", nproc, os.environ.get("LOCAL_WORLD_SIZE"))
    elif nproc is not None and nproc > 1:
        args = strip_nproc_flag(sub_argv)
        logger.info("starting %d workers: %s", nproc, shlex.join(worker_argv(command, args)))
        sys.stdout.flush()
        sys.stderr.flush()
        return launch(command, args, nproc)
    if command == "evaluate":  # several processes: under the recipe's layout
        run = _load_entry("hybridtrain.recipes.evaluate", "run", command)
        run(cfg, given_path(args.checkpoint, "--checkpoint"))
        return 0
    if command in ("finetune", "dpo", "grpo"):
        run = _load_entry(f"hybridtrain.recipes.{command}", "run", command)
        result = run(cfg)
    else:
        run = _load_entry("hybridtrain.recipes.benchmark", "run", command)
        result = run(cfg, args)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # A training command stopped by a signal before its run has started (torch importing, the
    # recipe loading) exits 75 like one stopped later, so that a requeue on 75 fires.
    command = next((a for a in argv if not a.startswith("-")), None)
    with stopping_at_once(DEFAULT_SIGNALS if command in RESUMABLE_COMMANDS else ()):
        try:
            return _main(argv)
        except Preempted as e:  # before the CLI's own handling began
            _report(f"hybridtrain: {e}")
            return e.exit_code


def _main(argv: list[str]) -> int:
    setup_logging()
    try:
        if argv and argv[0] == "generate":
            return _load_entry("hybridtrain.recipes.generate", "run", "generate")(argv[1:])
        if argv and argv[0] == "lm-eval":
            return _load_entry("hybridtrain.recipes.lm_harness", "run", "lm-eval")(argv[1:])
        if argv and argv[0] == "import-recipe":
            return _load_entry("hybridtrain.recipes.import_recipe", "run",
                               "import-recipe")(argv[1:])
        if argv and argv[0] == "merge":
            merge = _load_entry("hybridtrain.recipes.merge", "run", "merge")
            result = merge(argv[1:])
            return result if isinstance(result, int) and not isinstance(result, bool) else 0
        parser, known = build_parser()
        command = next((a for a in argv if not a.startswith("-")), None)
        if command in known:
            idx = argv.index(command)
            sub_argv = argv[idx + 1:]
            rest, overrides = split_cli_overrides(sub_argv, known[command])
            args = parser.parse_args(argv[: idx + 1] + rest)
            return _run_recipe(command, args, overrides, sub_argv)
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        if args.command == "convert":
            out_dir = output_folder(args.out_dir, "convert OUT_HF_DIR")
            convert = _load_entry("hybridtrain.training.checkpoint_reader", "convert", "convert")
            convert(given_path(args.ckpt_dir, "convert CKPT_DIR"), out_dir,
                    **({"dtype": args.dtype} if args.dtype else {}))
            return 0
        parser.error(f"unknown command {args.command!r}")
    except (ConfigError, CommandUnavailable) as e:
        _report(f"hybridtrain: error: {e}")
        return 2
    except Preempted as e:  # stopped on a signal or the time limit, with a checkpoint
        if _rank(os.environ) == 0:  # every rank stopped at the same step
            _report(f"hybridtrain: {e}")
        return e.exit_code
    except NothingToDo as e:  # a resume of a finished run (dpo, grpo): one line, exit 0
        if _rank(os.environ) == 0:
            print(e, flush=True)
        return 0
    except TrainingStopped as e:  # a run that cannot go on (e.g. diverged); said why
        _report(f"hybridtrain: error: {e}")
        return 3
    except ValueError as e:  # a user mistake found later (DESIGN: user errors are ValueError)
        logger.debug("traceback", exc_info=True)
        _report(f"hybridtrain: error: {e}\n(HYBRIDTRAIN_LOG_LEVEL=DEBUG shows the traceback)")
        return 2
    except KeyboardInterrupt:
        _report("hybridtrain: interrupted")
        return 130
    except OSError as e:  # a full or read-only disk: said plainly, naming the file
        err = write_error(e, "a file", None)
        if err is None:
            raise
        logger.debug("traceback", exc_info=True)
        _report(f"hybridtrain: error: {err}")
        return 2
    return 0


def _report(message: str) -> None:
    """Prints ``message`` to stderr, once over the workers of one launch
    (:func:`hybridtrain.launch.first_to_report`)."""
    if first_to_report(message):
        print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
