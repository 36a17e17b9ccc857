"""``hybridtrain <command> --nproc-per-node N``: N worker processes on this node.

Each worker is ``python -m hybridtrain <command> <arguments>`` with the environment torchrun
gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port; ``OMP_NUM_THREADS=1`` unless set), plus
``HYBRIDTRAIN_WATCH_PARENT=1`` (a worker ends when the launcher dies) and
``HYBRIDTRAIN_ERROR_DIR`` (see below), so it runs in-process exactly as under torchrun. What the
launcher does that torchrun does not:

* **Signals.** SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 sent to the launcher are passed on
  to every worker, and the launcher then waits for them as long as they take: a run stopped by
  a signal writes its checkpoint and exits 75 (``checkpoint.save_on_signal``). torchrun kills
  its workers a fixed time after passing a signal on, does not pass SIGUSR1 on by default, and
  exits 1 with a ``SignalException`` traceback whatever the workers did.
* **Exit status.** The launcher exits with the first non-zero status of a worker (75 stopped
  on a signal or time limit, 2 a user error, 3 a run that cannot go on; a worker killed by
  signal ``s`` counts as ``128 + s``), 0 when every worker succeeded. When one worker has failed
  the others get :data:`GRACE_S` seconds to end by themselves (they usually fail the same way,
  or wait in a collective for the failed one), then are killed.
* **One error message.** Workers run in their own process group (a Ctrl-C at the terminal
  reaches them once, through the launcher) and share the folder ``HYBRIDTRAIN_ERROR_DIR``: the
  CLI prints an error message only if no other worker printed the same one
  (:func:`first_to_report`), so a start-up error that every rank hits is printed once.

This module imports nothing heavy (the launcher process never imports torch).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

__all__ = ["launch", "worker_argv", "first_to_report", "FORWARDED_SIGNALS", "GRACE_S"]

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                     signal.SIGUSR2)
GRACE_S = 5.0  # seconds the other workers get to end by themselves after one has failed
ERROR_DIR_ENV = "HYBRIDTRAIN_ERROR_DIR"


def worker_argv(command: str, args: Sequence[str], python: str | None = None) -> list[str]:
    """The command line of one worker: ``hybridtrain <command> <args>`` in a new interpreter."""
    return [python or sys.executable, "-m", "hybridtrain", command, *args]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(rank: int, nproc: int, port: int, error_dir: str,
                base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), HYBRIDTRAIN_WATCH_PARENT="1")
    env[ERROR_DIR_ENV] = error_dir
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes share the cores
    return env


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launch(command: str, args: Sequence[str], nproc: int, grace_s: float = GRACE_S) -> int:
    """Runs ``nproc`` workers of ``hybridtrain <command> <args>``; returns the exit status
    (see the module docstring). Call from the main thread (it installs signal handlers)."""
    error_dir = tempfile.mkdtemp(prefix="hybridtrain-errors-")
    port = _free_port()
    argv = worker_argv(command, args)
    procs: list[subprocess.Popen] = []

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    status, deadline = 0, None
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen(
                argv, env=_worker_env(rank, nproc, port, error_dir, os.environ),
                process_group=0))  # a Ctrl-C reaches the workers once: through forward()
        while True:
            running = False
            for p in procs:
                code = p.poll()
                if code is None:
                    running = True
                elif code != 0 and status == 0:
                    status, deadline = _status(code), time.monotonic() + grace_s
            if not running:
                return status
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                deadline = None  # killed: wait for them to be reaped
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:  # the launcher itself failing (never the normal way out)
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(error_dir, ignore_errors=True)


def first_to_report(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """False when another worker of the same launch already printed ``message`` (under
    ``HYBRIDTRAIN_ERROR_DIR``); True otherwise (then the caller prints it). Atomic: the first
    worker to create the message's file wins."""
    environ = os.environ if environ is None else environ
    folder = environ.get(ERROR_DIR_ENV)
    if not folder:
        return True
    name = hashlib.sha256(message.encode("utf-8", "replace")).hexdigest()[:32]
    try:
        os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # the folder is gone or unwritable: rather twice than never
        return True
    return True
