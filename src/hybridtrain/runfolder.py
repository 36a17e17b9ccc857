"""The run folder (``checkpoint.dir``) of one run at a time.

::

    out_dir = run_folder_path(cfg.checkpoint.dir)   # absolute; ValueError if a file is in the way
    latest_checkpoint(out_dir)    # its step_N folder that `latest` names (None without one)
    with RunLock(out_dir):        # RunFolderBusy (a ValueError) if another live process holds it
        ...                       # the lock file goes when the block ends

The lock is the file ``.lock`` in the run folder holding ``host pid`` of its holder, created with
``O_EXCL`` (atomic on local and NFS v3+ file systems) and removed on exit. A lock whose holder is
on this host and no longer runs is stale: it is replaced with a warning. A lock held from another
host cannot be checked and is refused with the holder named (delete ``.lock`` if that run is gone).

Also :class:`TrainingStopped`, the error of a run that cannot go on (``hybridtrain`` exits with
status 3 and its message). This module imports nothing heavy (the CLI uses it).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import time

__all__ = ["RunLock", "RunFolderBusy", "TrainingStopped", "LOCK_NAME", "STEP_RE",
           "latest_checkpoint", "run_folder_path"]

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
STEP_RE = re.compile(r"^step_(\d+)$")  # a checkpoint folder of the run folder


class TrainingStopped(RuntimeError):
    """A run stopped on purpose before its end (the message says why and what to do)."""


class RunFolderBusy(ValueError):
    """Another live run holds the run folder."""


def run_folder_path(folder: str | os.PathLike, key: str = "checkpoint.dir") -> str:
    """``folder`` made absolute; a ``ValueError`` naming ``key`` when it, or the nearest part
    of it that exists, is not a folder (a run could not create its folder there)."""
    path = os.path.abspath(os.fspath(folder))
    part = path
    while not os.path.exists(part) and os.path.dirname(part) != part:
        part = os.path.dirname(part)
    if not os.path.isdir(part):
        what = "is a file" if part == path else f"lies under {part}, which is a file"
        raise ValueError(f"{key}: {path} {what}, not a folder; give a folder for the run's "
                         "output (it is created if missing)")
    return path


def latest_checkpoint(run_dir: str) -> str | None:
    """The ``step_N`` folder of ``run_dir`` its ``latest`` file names (None without one). The
    file is data, not a path to follow: a name other than ``step_N``, or a ``step_N`` that is a
    link out of the run folder, is refused."""
    path = os.path.join(run_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as f:
        name = f.read(256).strip()
    ckpt = os.path.join(run_dir, name)
    inside = os.path.realpath(ckpt).startswith(os.path.realpath(run_dir) + os.sep)
    if not STEP_RE.match(name) or not inside:
        raise ValueError(
            f"{path} names {name!r}, not a step_N folder of the run folder {run_dir} (it would "
            "lead out of it); rewrite it with the step to resume (e.g. step_100), or pass the "
            "checkpoint itself: --checkpoint.resume=PATH/step_N")
    if not os.path.isdir(ckpt):
        raise ValueError(f"{path} names {name!r}, which does not exist in {run_dir}")
    return ckpt


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


class RunLock:
    """An exclusive lock on ``folder`` for this process (see module docstring)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.path.abspath(os.fspath(folder))
        self.path = os.path.join(self.folder, LOCK_NAME)
        self.held = False

    def _holder(self) -> tuple[str, int] | None:
        try:
            with open(self.path) as f:
                host, pid = f.read().split()
            return host, int(pid)
        except (OSError, ValueError):
            return None

    def acquire(self) -> "RunLock":
        os.makedirs(self.folder, exist_ok=True)
        me = f"{socket.gethostname()} {os.getpid()}\n"
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # being written, or garbage: look again
                    time.sleep(0.2)
                    holder = self._holder()
                if holder is not None and holder[0] == socket.gethostname() \
                        and not _alive(holder[1]):
                    logger.warning("%s: removing the stale lock of process %d (no longer "
                                   "running)", self.folder, holder[1])
                    try:
                        os.remove(self.path)
                    except FileNotFoundError:
                        pass
                    continue
                who = (f"process {holder[1]} on {holder[0]}" if holder else
                       f"an unknown process (unreadable {self.path})")
                raise RunFolderBusy(
                    f"checkpoint.dir {self.folder} is in use by {who}: two runs must not write "
                    f"one run folder. Wait for it to end, choose another checkpoint.dir, or, if "
                    f"that run is gone, delete {self.path}") from None
            except OSError as e:
                if e.errno in (errno.EROFS, errno.EACCES, errno.ENOSPC):
                    raise ValueError(f"cannot lock checkpoint.dir {self.folder}: {e.strerror} "
                                     f"({self.path})") from None
                raise
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held = True
            return self
        raise RunFolderBusy(f"checkpoint.dir {self.folder}: could not take {self.path}")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._holder()
        if holder is not None and holder[1] == os.getpid():
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
