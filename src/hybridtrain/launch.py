"""``hybridtrain <command> --nproc-per-node N``: N worker processes on this node.

Each worker is ``python -m hybridtrain <command> <arguments>`` with the environment torchrun
gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``; ``OMP_NUM_THREADS=1`` unless set), plus
``HYBRIDTRAIN_WATCH_PARENT=1`` (a worker ends when the launcher dies) and
``HYBRIDTRAIN_ERROR_DIR`` (see below), so it runs in-process exactly as under torchrun. What the
launcher does (docs/distributed.md compares it with torchrun's flags):

* **Rendezvous without a port race.** The launcher opens the rendezvous socket itself (port 0:
  the kernel picks a free one) and hands the listening socket to rank 0
  (``HYBRIDTRAIN_STORE_FD``), whose process-group store serves on it while the other ranks
  connect to it (``HYBRIDTRAIN_LAUNCHER_STORE=1``;
  :func:`hybridtrain.distributed.init.init_distributed`); no port is picked, released and
  bound again, so two launches on one machine never collide.
* **Output.** Every line a worker writes to stdout or stderr is written to the launcher's with
  the prefix ``[rank N] `` (torchrun: ``--tee 3 --role``-style ``[default0]:``).
* **Signals.** SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 sent to the launcher are passed on
  to every worker; a run stopped by a signal writes its checkpoint and exits 75
  (``checkpoint.save_on_signal``). The launcher waits for that at most
  ``HYBRIDTRAIN_SHUTDOWN_TIMEOUT`` seconds (default :data:`SHUTDOWN_TIMEOUT_S`: longer than a
  sharded checkpoint save), then kills the workers that are left and says so.
* **Exit status.** The launcher exits with the first non-zero status of a worker (75 stopped
  on a signal or time limit, 2 a user error, 3 a run that cannot go on; a worker killed by
  signal ``s`` counts as ``128 + s``), 0 when every worker succeeded. When one worker has failed
  the others get :data:`GRACE_S` seconds to end by themselves (they usually fail the same way,
  or wait in a collective for the failed one), then are killed.
* **One error message.** Workers run in their own session (a Ctrl-C at the terminal reaches
  them once, through the launcher) and share the folder ``HYBRIDTRAIN_ERROR_DIR``: the CLI
  prints an error message only if no other worker printed the same one
  (:func:`first_to_report`), so a start-up error that every rank hits is printed once.

This module uses only the standard library of every Python the package supports (3.10 on) and
imports nothing heavy (the launcher process never imports torch).
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
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

__all__ = ["launch", "run_workers", "worker_argv", "first_to_report", "shutdown_timeout",
           "FORWARDED_SIGNALS", "GRACE_S", "SHUTDOWN_TIMEOUT_S", "STORE_ENV", "STORE_FD_ENV"]

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                     signal.SIGUSR2)
GRACE_S = 5.0  # seconds the other workers get to end by themselves after one has failed
SHUTDOWN_TIMEOUT_S = 900.0  # seconds the workers get after a forwarded signal (save and exit)
SHUTDOWN_TIMEOUT_ENV = "HYBRIDTRAIN_SHUTDOWN_TIMEOUT"
ERROR_DIR_ENV = "HYBRIDTRAIN_ERROR_DIR"
STORE_ENV = "HYBRIDTRAIN_LAUNCHER_STORE"  # "1": the ranks meet on the launcher's socket
STORE_FD_ENV = "HYBRIDTRAIN_STORE_FD"  # rank 0: that listening socket's file descriptor


def worker_argv(command: str, args: Sequence[str], python: str | None = None) -> list[str]:
    """The command line of one worker: ``hybridtrain <command> <args>`` in a new interpreter."""
    return [python or sys.executable, "-m", "hybridtrain", command, *args]


def shutdown_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds the workers get to end after a forwarded signal: ``HYBRIDTRAIN_SHUTDOWN_TIMEOUT``
    or :data:`SHUTDOWN_TIMEOUT_S`."""
    environ = os.environ if environ is None else environ
    text = environ.get(SHUTDOWN_TIMEOUT_ENV)
    if not text:
        return SHUTDOWN_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{SHUTDOWN_TIMEOUT_ENV}={text!r}: give the seconds the workers get to "
                         f"save and exit after a signal, a positive number (default "
                         f"{SHUTDOWN_TIMEOUT_S:g})")
    return value


def _worker_env(rank: int, nproc: int, port: int, error_dir: str,
                base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    env.pop(STORE_FD_ENV, None)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), HYBRIDTRAIN_WATCH_PARENT="1")
    env[ERROR_DIR_ENV] = error_dir
    env[STORE_ENV] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes share the cores
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the launcher when written
    return env


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _prefix_lines(source: BinaryIO, sink: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    """Copy ``source`` to ``sink`` line by line, each line led by ``prefix``."""
    with source:
        for line in iter(source.readline, b""):
            with lock:
                sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                sink.flush()


def launch(command: str, args: Sequence[str], nproc: int, grace_s: float = GRACE_S,
           shutdown_timeout_s: float | None = None) -> int:
    """Runs ``nproc`` workers of ``hybridtrain <command> <args>``; returns the exit status
    (see the module docstring). Call from the main thread (it installs signal handlers)."""
    return run_workers(worker_argv(command, args), nproc, grace_s, shutdown_timeout_s)


def run_workers(argv: Sequence[str], nproc: int, grace_s: float = GRACE_S,
                shutdown_timeout_s: float | None = None,
                environ: Mapping[str, str] | None = None) -> int:
    """Runs ``nproc`` copies of the command ``argv`` as ranks 0..nproc-1 (the environment and
    behaviour of :func:`launch`); returns the exit status."""
    environ = os.environ if environ is None else environ
    if shutdown_timeout_s is None:
        shutdown_timeout_s = shutdown_timeout(environ)
    out = getattr(sys.stdout, "buffer", sys.stdout)
    err = getattr(sys.stderr, "buffer", sys.stderr)
    locks = {id(out): threading.Lock(), id(err): threading.Lock()}
    error_dir = tempfile.mkdtemp(prefix="hybridtrain-errors-")
    listener = socket.create_server(("127.0.0.1", 0), backlog=max(128, nproc))
    port = listener.getsockname()[1]
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    signalled: list[int] = []

    def forward(signum, frame):
        signalled.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    status, deadline, stop_deadline = 0, None, None
    try:
        for rank in range(nproc):
            env = _worker_env(rank, nproc, port, error_dir, environ)
            fds = ()
            if rank == 0:
                env[STORE_FD_ENV] = str(listener.fileno())
                fds = (listener.fileno(),)
            p = subprocess.Popen(argv, env=env, pass_fds=fds, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE,
                                 start_new_session=True)  # a Ctrl-C reaches it once: forward()
            procs.append(p)
            for source, sink in ((p.stdout, out), (p.stderr, err)):
                t = threading.Thread(target=_prefix_lines, daemon=True,
                                     args=(source, sink, f"[rank {rank}] ".encode(),
                                           locks[id(sink)]))
                t.start()
                readers.append(t)
        listener.close()  # rank 0 holds it now
        while True:
            running = False
            for p in procs:
                code = p.poll()
                if code is None:
                    running = True
                elif code != 0 and status == 0:  # a worker stopped after saving (75): the
                    # others are saving too, as long as a forwarded signal would give them
                    wait = shutdown_timeout_s if code == 75 else grace_s
                    status, deadline = _status(code), time.monotonic() + wait
            if not running:
                return status
            now = time.monotonic()
            if signalled and stop_deadline is None:
                stop_deadline = now + shutdown_timeout_s
            if stop_deadline is not None and now > stop_deadline:
                name = signal.Signals(signalled[0]).name
                with locks[id(err)]:
                    err.write(f"hybridtrain: the workers did not end within {shutdown_timeout_s:g}"
                              f" s of {name} ({SHUTDOWN_TIMEOUT_ENV}); killing them\n".encode())
                    err.flush()
                deadline, stop_deadline = now, float("inf")
            if deadline is not None and now > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                deadline = None  # killed: wait for them to be reaped
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        listener.close()
        for p in procs:  # the launcher itself failing (never the normal way out)
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in readers:  # the rest of the output (a worker's own children may hold the pipe)
            t.join(timeout=5)
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
