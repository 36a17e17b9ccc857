"""``python -m hybridtrain``: the CLI, with a training command's early stop on a signal in
place before anything is imported (:func:`hybridtrain.cli.main`)."""

import sys

from hybridtrain.training.preemption import (
    DEFAULT_SIGNALS, EXIT_PREEMPTED, RESUMABLE_COMMANDS, Preempted, stopping_at_once,
)

with stopping_at_once(DEFAULT_SIGNALS if sys.argv[1:2] and sys.argv[1] in RESUMABLE_COMMANDS
                      else ()):
    try:
        from hybridtrain.cli import main
    except Preempted as e:
        print(f"hybridtrain: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED) from None
    code = main()
raise SystemExit(code)
