"""Stopping a run early with a checkpoint: on a signal, or before a wall-clock limit.

Clusters end jobs with a signal (Slurm: SIGTERM at preemption, ``--signal=USR1@120`` before the
time limit). With ``checkpoint.save_on_signal`` (default ``[SIGTERM, SIGUSR1]``) the handler
only records the signal; at the next step boundary every rank adds its flag to one all-reduce
(MAX over the default group), so all ranks stop after the same step even when only some got the
signal. The run then saves a checkpoint (the usual atomic ``.step_N.tmp`` + rename), releases
the run folder, and exits with :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: "try again later";
2 stays a user error and 3 a run that cannot go on). A signal that arrives while a checkpoint is
being written is noted and changes nothing: the save goes on (were the process killed, the
previous checkpoint stays whole).

``training.max_time`` (``"3h50m"``, counted from the start of the recipe) stops the run the
same way, with the same exit status, at the first step boundary where the time left is less
than the longest interval between two step boundaries seen so far plus 1.5 times the duration
of the run's latest save. When no save has been timed yet, a checkpoint is written at the first
step boundary to time one.

    stop = RunStop.from_config(cfg, device)
    with stop.catching():                  # handlers installed; the previous ones restored
        for step in ...:
            ...                            # one step
            reason = stop.requested()      # collective: every rank, once per step
            if reason:
                with stop.saving():
                    save()
                raise Preempted(...)

Outside the step loop (building, loading) :func:`stopping_at_once` makes the same signals end
the run at once, also with exit 75 (nothing new to save; the run folder's lock is released, so a
requeued job on another node can take it). The CLI installs it for the training commands
(:data:`RESUMABLE_COMMANDS`) before anything heavy is imported, with the default signals until
the recipe is read: a SIGTERM while torch is still importing exits 75 too, so a requeue on 75
fires.

Every write into the run folder (a checkpoint, the export, ``latest``, ``final``) runs under
:func:`deferred_signals`: SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 wait until it is complete
and then reach the handler that was in place (a step loop's records it; Ctrl-C's raises
``KeyboardInterrupt``: exit 130 after an intact save; a default action ends the process).

This module imports torch only when it all-reduces and the recipe's parsers only when it reads
a recipe (the CLI imports it first thing).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence

from hybridtrain.runfolder import TrainingStopped

__all__ = ["RunStop", "Preempted", "EXIT_PREEMPTED", "RESUMABLE_COMMANDS", "DEFAULT_SIGNALS",
           "deferred_signals", "stopping_at_once"]

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75
_TIME_LIMIT = 1000  # the flag of the time limit (above every signal number)
SAVE_MARGIN = 1.5  # the expected save takes this many times the last one
# checkpoint.save_on_signal's default: the signals that stop a run before its recipe is read
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# what a save never lets cut it short (the signals the launcher passes on)
DEFERRED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# the commands whose exit status 75 means "run again to continue"
RESUMABLE_COMMANDS = ("finetune", "benchmark", "dpo", "grpo")


class Preempted(TrainingStopped):
    """The run stopped on a signal or its time limit after saving a checkpoint; ``hybridtrain``
    exits with :data:`EXIT_PREEMPTED`."""

    exit_code = EXIT_PREEMPTED


class RunStop:
    """When to stop early (see the module docstring). ``signals``: signal numbers to catch;
    ``max_time_s``: the time limit in seconds (None: none), counted from ``started``
    (``time.perf_counter()``; default: now); ``device``: where the all-reduced flag lives (the
    process group's device)."""

    def __init__(self, signals: Sequence[int] = (), max_time_s: float | None = None,
                 started: float | None = None, device=None, max_time_text: str | None = None):
        self.signals = list(signals)
        self.max_time_s = max_time_s
        self.max_time_text = max_time_text or (f"{max_time_s:g}s" if max_time_s else None)
        self.started = time.perf_counter() if started is None else started
        self.device = device
        self.received: list[int] = []  # every caught signal, in order
        self.save_s: float | None = None  # duration of the latest save
        self.longest_interval = 0.0  # between two step boundaries, saves excluded
        self._boundary: float | None = None
        self._previous: dict[int, object] = {}

    @classmethod
    def from_config(cls, cfg, device=None, started: float | None = None) -> "RunStop":
        """From ``checkpoint.save_on_signal`` and ``training.max_time`` of a loaded recipe."""
        # (a light start-up: the CLI installs its signal handlers before torch or the recipe loads)
        from hybridtrain.config.text_values import parse_duration, parse_signals

        text = cfg.training.max_time
        return cls(parse_signals(cfg.checkpoint.save_on_signal),
                   parse_duration(text) if text is not None else None, started, device,
                   str(text) if text is not None else None)

    @property
    def active(self) -> bool:
        return bool(self.signals) or self.max_time_s is not None

    # -- signal handlers ---------------------------------------------------------------------
    def _handle(self, signum, frame) -> None:
        self.received.append(signum)  # only this: the handler runs between any two bytecodes

    def install(self) -> None:
        """Catches ``signals`` (from the main thread only; elsewhere a warning)."""
        if not self.signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("checkpoint.save_on_signal: not in the main thread; signals keep "
                           "their default action")
            return
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        """Puts the handlers found by :meth:`install` back."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    @contextlib.contextmanager
    def catching(self) -> Iterator["RunStop"]:
        self.install()
        try:
            yield self
        finally:
            self.restore()

    # -- step boundaries ---------------------------------------------------------------------
    def _local_flag(self, now: float) -> int:
        if self.received:
            return self.received[0]
        if self.max_time_s is not None:
            reserve = self.longest_interval + SAVE_MARGIN * (self.save_s or 0.0)
            if now - self.started + reserve >= self.max_time_s:
                return _TIME_LIMIT
        return 0

    def requested(self) -> str | None:
        """At a step boundary, on every rank (one all-reduce when several): why the run stops
        now (``"SIGTERM received"``, ``"training.max_time=3h50m is near"``), or None."""
        if not self.active:
            return None
        now = time.perf_counter()
        if self._boundary is not None:
            self.longest_interval = max(self.longest_interval, now - self._boundary)
        self._boundary = now
        flag = self._local_flag(now)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            t = torch.tensor([flag], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        if flag == 0:
            return None
        if flag == _TIME_LIMIT:
            return f"training.max_time={self.max_time_text} is near"
        return f"{signal.Signals(flag).name} received"

    def needs_timed_save(self) -> bool:
        """True while a time limit is set and no save has been timed yet."""
        return self.max_time_s is not None and self.save_s is None

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around a checkpoint save: times it (excluded from the step intervals) and logs the
        signals that arrived meanwhile."""
        before, t0 = len(self.received), time.perf_counter()
        try:
            yield
        finally:
            self.save_s = time.perf_counter() - t0
            if self._boundary is not None:
                self._boundary += self.save_s
            late = self.received[before:]
            if late:
                logger.warning("%s received while a checkpoint was being written: noted; the "
                               "save went on", ", ".join(signal.Signals(s).name for s in late))


@contextlib.contextmanager
def deferred_signals(signals: Sequence[int] = DEFERRED_SIGNALS) -> Iterator[None]:
    """While inside, ``signals`` are only noted; when the block completes, the handlers in place
    before are back and get each noted signal once, in the order they came (a block that fails
    drops them: its error ends the run). Ignored signals stay ignored. Nests; main thread only
    (elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = {}
    for s in signals:
        if signal.getsignal(s) not in (signal.SIG_IGN, None):
            previous[s] = signal.signal(s, lambda signum, frame: noted.append(signum))
    ok = False
    try:
        yield
        ok = True
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if noted and not ok:
            logger.warning("%s received while writing: the write failed (see the error)",
                           ", ".join(signal.Signals(s).name for s in dict.fromkeys(noted)))
        elif noted:
            for s in dict.fromkeys(noted):
                signal.raise_signal(s)


def _raise_preempted(signum, frame):
    raise Preempted(f"{signal.Signals(signum).name} received outside the training steps: stopped "
                    "without a new checkpoint; run again (with --checkpoint.resume=auto to "
                    "continue from the latest one)")


@contextlib.contextmanager
def stopping_at_once(cfg_or_signals, release: Sequence[int] = ()) -> Iterator[None]:
    """While inside: the recipe's ``checkpoint.save_on_signal`` signals (or the signal numbers
    given) raise :class:`Preempted` at once (the step loop's :meth:`RunStop.catching` overrides
    this while it runs); the signals of ``release`` that are not among them get their default
    action back. Main thread only; elsewhere nothing changes."""
    if hasattr(cfg_or_signals, "checkpoint"):
        from hybridtrain.config.text_values import parse_signals  # (a light start-up, as above)

        signals = parse_signals(cfg_or_signals.checkpoint.save_on_signal)
    else:
        signals = list(cfg_or_signals)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in signals:
            previous[s] = signal.signal(s, _raise_preempted)
        for s in release:
            if s not in previous:
                previous[s] = signal.signal(s, signal.SIG_DFL)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
