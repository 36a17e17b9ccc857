"""Workers end when their launcher dies.

``hybridtrain finetune --nproc-per-node N`` becomes ``torchrun``, which starts the N workers. If
torchrun is killed (``kill -9``, an OOM kill, a lost ssh session) the workers would otherwise
run on as orphans, train to the end and write checkpoints. Each worker started by a launcher
runs :func:`watch_parent`: a daemon thread that checks every ``interval`` seconds whether the
process's parent is still the one it started with (an orphan is re-parented to init or a
sub-reaper) and, when not, prints why and ends the process at once (``os._exit``: other ranks
then fail their next collective and end too; the run folder's lock is left behind as a stale
lock, which the next run replaces). Polling rather than ``prctl(PR_SET_PDEATHSIG)``: that
signal fires when the *thread* that forked the worker exits, which is not the launcher's death.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Mapping

__all__ = ["watch_parent", "launched_by_launcher"]

_STARTED: list[threading.Thread] = []


def launched_by_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True in a worker that torchrun (torch elastic) started, or with
    ``HYBRIDTRAIN_WATCH_PARENT=1`` (workers of other launchers)."""
    environ = os.environ if environ is None else environ
    return bool(environ.get("TORCHELASTIC_RUN_ID")) or environ.get("HYBRIDTRAIN_WATCH_PARENT") == "1"


def _watch(parent: int, interval: float) -> None:
    while True:
        time.sleep(interval)
        if os.getppid() != parent:
            try:  # stderr may be a pipe to the launcher that died with it
                sys.stderr.write(f"hybridtrain: error: the launcher (pid {parent}) of worker "
                                 f"{os.getpid()} is gone; ending this worker\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os._exit(1)


def watch_parent(interval: float = 1.0) -> bool:
    """Starts the watch (once per process); False when the parent is already init (nothing to
    watch)."""
    if _STARTED:
        return True
    parent = os.getppid()
    if parent <= 1:
        return False
    t = threading.Thread(target=_watch, args=(parent, interval), name="hybridtrain-parent-watch",
                         daemon=True)
    t.start()
    _STARTED.append(t)
    return True
