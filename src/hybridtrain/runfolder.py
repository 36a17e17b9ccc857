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

Only the lock holder (the training run) changes the folder: when it takes the lock it removes
what a dead writer left (``.step_N.tmp`` being written, ``.step_N.old`` being deleted). Readers
(``convert``, ``evaluate``, ``generate``) never write there, take no lock and break none; they
ask :func:`live_holder` who writes the folder, and pin the checkpoint they read
(:func:`pin_step`: a shared ``flock`` on its ``trainer_state.json``, opened read-only), which
the writer's rotation (``checkpoint.keep_last``) leaves in place until the reader is done
(:func:`unpinned`).

Also :class:`TrainingStopped`, the error of a run that cannot go on (``hybridtrain`` exits with
status 3 and its message). This module imports nothing heavy (the CLI uses it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import time

__all__ = ["RunLock", "RunFolderBusy", "TrainingStopped", "NothingToDo", "LOCK_NAME", "STEP_RE", "PARTIAL_RE",
           "latest_checkpoint", "live_holder", "pin_step", "unpinned", "run_folder_path"]

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
STEP_RE = re.compile(r"^step_(\d+)$")  # a checkpoint folder of the run folder
# a checkpoint being written (.tmp) or being deleted (.old): only its writer may touch it
PARTIAL_RE = re.compile(r"^\.step_(\d+)\.(tmp|old)$")
PINNED_FILE = "trainer_state.json"  # the file of a step folder a reader holds a shared flock on


class TrainingStopped(RuntimeError):
    """A run stopped on purpose before its end (the message says why and what to do)."""


class NothingToDo(Exception):
    """A resume whose checkpoint is at or past the run's last step: the message says so in one
    line; the command exits 0 without writing anything."""


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


def _read_holder(lock_path: str) -> tuple[str, int] | None:
    try:
        with open(lock_path) as f:
            host, pid = f.read().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def live_holder(folder: str | os.PathLike) -> str | None:
    """Who holds ``folder``'s lock (``"process 123 on host"``), or None when nobody does or its
    holder on this host is gone. Reads only."""
    holder = _read_holder(os.path.join(os.fspath(folder), LOCK_NAME))
    if holder is None or (holder[0] == socket.gethostname() and not _alive(holder[1])):
        return None
    return f"process {holder[1]} on {holder[0]}"


def pin_step(step_dir: str | os.PathLike) -> int | None:
    """A reader's pin on the checkpoint ``step_dir``: the file descriptor of its
    ``trainer_state.json`` opened read-only with a shared ``flock`` (close it to unpin); None
    when the file system has no locks. ``FileNotFoundError`` when the step is gone (rotated
    away before it was pinned)."""
    path = os.path.join(os.fspath(step_dir), PINNED_FILE)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.stat(path).st_ino != os.fstat(fd).st_ino:  # moved away while we waited
            raise FileNotFoundError(errno.ENOENT, "checkpoint rotated away", path)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise
    return fd


def unpinned(step_dir: str | os.PathLike) -> contextlib.AbstractContextManager[bool]:
    """``with unpinned(step) as free:`` ``free`` is True when no reader pins ``step`` (the
    writer holds an exclusive lock on it for the block, so no reader pins it meanwhile);
    False when one does (leave it for later). True without a file to lock or locks."""
    return _exclusive(os.path.join(os.fspath(step_dir), PINNED_FILE))


@contextlib.contextmanager
def _exclusive(path: str):
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        except OSError:  # no locks on this file system
            pass
        yield True
    finally:
        os.close(fd)


def _remove_partial(folder: str) -> None:
    """The lock holder's cleaning: what a dead writer left being written or deleted."""
    for name in os.listdir(folder):
        if PARTIAL_RE.match(name):
            path = os.path.join(folder, name)
            if name.endswith(".tmp"):
                logger.warning("removing incomplete checkpoint %s (a run died while writing it)",
                               path)
            shutil.rmtree(path, ignore_errors=True)


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
        return _read_holder(self.path)

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
            _remove_partial(self.folder)
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
            except OSError as e:  # e.g. the disk turned read-only: the error that stopped the
                # run (raised meanwhile) is the one to report; the lock is stale once we exit
                logger.warning("could not remove the run folder's lock %s (%s); the next run "
                               "replaces it (its process is gone)", self.path, e.strerror)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
