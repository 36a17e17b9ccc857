"""What the RL recipes (``dpo``, ``grpo``) share: the run folder (locked while the run lasts),
the trained Policy and its frozen reference, the step log (``training.jsonl``, progress bar,
``loss.png`` with the recipe's own curves), checkpoints and resume, the final checkpoint with its
export, and the summary.

    with process_group(cfg), rl_run(cfg, "dpo") as r:
        saved = r.begin(loop_state, steps, batch_size)  # {}, or a resumed run's loop state
        for step in range(r.step + 1, steps + 1):
            ...                              # one step: r.train(...), r.log({"step": step, ...})
            r.stop_if_requested(last=step == steps)
        return r.finish(headline)

Resume (``checkpoint.resume``: ``auto`` or a ``step_N`` path) continues the run exactly as
finetune's does: the Policy's weights, optimizer, LR schedule, update count and every rank's
global RNG states come from the checkpoint (:meth:`Policy.load_checkpoint`), the recipe's own
loop state (``loop_state()``: its generators, data order, as JSON) from the checkpoint's
``extra``; ``training.jsonl`` / ``validation.jsonl`` drop the lines past the resumed step
(:class:`~hybridtrain.training.metrics.MetricsLogger`). The frozen reference is the recipe's model
built again, never saved. ``step_N`` counts the recipe's steps (GRPO: rollouts), not updates."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hybridtrain.config import ConfigNode
from hybridtrain.distributed.utils import is_main_process
from hybridtrain.fileio import atomic_write, read_json
from hybridtrain.recipes.finetune import _check_run_folder
from hybridtrain.rl import Policy
from hybridtrain.runfolder import NothingToDo, RunLock, run_folder_path
from hybridtrain.training.builder import check_input_paths
from hybridtrain.training.checkpoint import nothing_left
from hybridtrain.training.metrics import metrics_logger, read_jsonl
from hybridtrain.training.preemption import Preempted, RunStop, stopping_at_once
from hybridtrain.training.trainer import TrainingDiverged

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def rl_run(cfg: ConfigNode, name: str, **kwargs) -> Iterator["RLRun"]:
    """An :class:`RLRun` (``kwargs``: its options) in its run folder, which rank 0 locks (the
    ``.lock`` of :class:`~hybridtrain.runfolder.RunLock`, as finetune) until the run ends, however
    it ends (exit 75 included); a folder created for a run that wrote nothing is removed again.
    Outside the step loop a ``checkpoint.save_on_signal`` signal stops the run at once
    (:func:`~hybridtrain.training.preemption.stopping_at_once`)."""
    out_dir = run_folder_path(cfg.checkpoint.dir)
    lock = RunLock(out_dir) if is_main_process() else None
    created = lock is not None and not os.path.exists(out_dir)
    if lock is not None:
        lock.acquire()
    try:
        with stopping_at_once(cfg):
            yield RLRun(cfg, name, **kwargs)
    finally:
        if lock is not None:
            lock.release()
            if created:
                with contextlib.suppress(OSError):
                    os.rmdir(out_dir)  # only if empty


def _check_resumable(path: str, name: str) -> None:
    """Refuses to resume ``name`` from a checkpoint that another recipe wrote."""
    state_path = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state_path):
        return  # Checkpointer.load names the broken checkpoint
    wrote = (read_json(state_path).get("extra") or {}).get("recipe")
    if wrote != name:
        raise ValueError(
            f"checkpoint.resume: {path} is not a checkpoint of a `hybridtrain {name}` run ("
            + (f"`hybridtrain {wrote}` wrote it" if wrote else "`hybridtrain finetune` wrote it, "
               "or a dpo/grpo run of a version that did not resume")
            + f"); resume continues a run of the same recipe. To start {name} from that model, "
            f"set model.local_dir to its export (`hybridtrain convert {path} OUT_DIR`) and use a "
            "new checkpoint.dir")


@contextlib.contextmanager
def _info_lines_off():
    """hybridtrain's INFO lines off for the block (warnings stay; DEBUG logging shows all)."""
    log = logging.getLogger("hybridtrain")
    level = log.level
    if log.getEffectiveLevel() == logging.INFO:
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


class RLRun:
    """``Policy`` + frozen reference (the same recipe: the same initial weights) + metrics in
    ``checkpoint.dir``; use it through :func:`rl_run`. An earlier run there is continued with
    ``checkpoint.resume`` (:meth:`begin`), or replaced with ``checkpoint.overwrite``. Saves
    every ``training.ckpt_every_steps`` steps, and stops early with a checkpoint on a signal or
    near ``training.max_time`` (:meth:`stop_if_requested`, called after every step)."""

    def __init__(self, cfg: ConfigNode, name: str, plot_extra: Sequence[str] = (),
                 loss_label: str = "loss"):
        self.cfg, self.name = cfg, name
        self.out_dir = run_folder_path(cfg.checkpoint.dir)
        self.t_start = time.perf_counter()
        self.resume_from, clear = _check_run_folder(cfg, self.out_dir)
        if self.resume_from is not None:
            _check_resumable(self.resume_from, name)
            t = cfg.training
            done = t.max_steps is not None and nothing_left(self.resume_from, t.max_steps)
            if done:
                raise NothingToDo(done)
        check_input_paths(cfg)  # before two models are built
        self.policy = Policy(cfg)
        t0 = time.perf_counter()
        with _info_lines_off():  # the same build again: its log would repeat the policy's
            self.reference = Policy(cfg)  # never trained: the reference policy
        logger.info("reference policy: the recipe's model built again and kept frozen (%.1fs)",
                    time.perf_counter() - t0)
        self.is_main = self.policy.built.is_main
        self._clear = clear
        self.metrics = metrics_logger(cfg, self.out_dir, self.is_main, plot_extra=plot_extra,
                                      loss_label=loss_label)
        self.history: list[dict] = []
        self.val_history: list[dict] = []
        self.step = 0  # the recipe's steps done (the last logged one)
        self.steps: int | None = None  # the run's steps (begin())
        self.loop_state: Callable[[], dict] | None = None
        self._saved_step: int | None = None  # the step of this process's latest save
        self.stop = RunStop.from_config(cfg, self.policy.device, self.t_start)
        self.stop.install()  # until finish() or the early stop

    def begin(self, loop_state: Callable[[], dict], steps: int, samples_per_update: int,
              updates_per_step: int = 1) -> dict:
        """Before the step loop (after everything is built). ``loop_state()``: what the recipe's
        loop needs to go on exactly (its own generators, data order; JSON), saved with every
        checkpoint. The run makes ``steps`` steps of ``updates_per_step`` optimizer updates of
        ``samples_per_update`` samples each: the LR schedule's length and the progress bar's. A resumed run restores the Policy and :attr:`step` from ``checkpoint.resume``
        and gets the loop state saved there; a new run gets ``{}``. Only then writes into the run
        folder: clears an earlier run (``checkpoint.overwrite``), writes ``config.yaml``, opens
        the metrics files (a resumed run's lose their lines past the resumed step). Collective."""
        self.loop_state = loop_state
        self.steps = steps
        self.policy.set_run_length(steps * updates_per_step, samples_per_update)
        saved: dict = {}
        if self.resume_from is not None:
            state = self.policy.load_checkpoint(self.resume_from)
            self.step = self._saved_step = int(state["step"])
            saved = state["extra"].get("loop", {})
        if self._clear:
            self.policy.checkpointer(self.out_dir).clear()
        if self.is_main:
            atomic_write(os.path.join(self.out_dir, "config.yaml"), self.cfg.to_yaml())
        self.metrics.open(self.step, steps)
        if self.step:  # the run so far, for the summary
            self.history = [x for x in read_jsonl(self.metrics.train_path)
                            if x.get("step", 0) <= self.step]
            self.val_history = [x for x in read_jsonl(self.metrics.val_path)
                                if x.get("step", 0) <= self.step]
        return saved

    def train(self, batch: dict, loss_fn, cause: str | None = None, **kwargs) -> dict[str, Any]:
        """``policy.train``; a run that the skipped-update limit stops closes its logs first and
        names ``cause`` (what the recipe knows made the updates non-finite) in its error."""
        try:
            return self.policy.train(batch, loss_fn, **kwargs)
        except TrainingDiverged as e:
            self.metrics.close()
            raise TrainingDiverged(f"{e}" + (f". First cause: {cause}" if cause else "")) from None

    def log_val(self, rec: dict[str, Any]) -> None:
        self.val_history.append(rec)
        self.metrics.log_val(rec)

    def log(self, rec: dict[str, Any]) -> None:
        """The record of step ``rec["step"]`` (which becomes :attr:`step`)."""
        assert self.loop_state is not None, "RLRun.begin() comes before the first step"
        self.step = rec["step"]
        self.history.append(rec)
        self.metrics.log_train(rec)
        self.metrics.progress(rec["step"], rec.get("loss"), rec.get("lr", 0.0), None)

    def save(self, export: bool = False) -> str:
        """``step_{N}`` (N: :attr:`step`) with the loop state; collective. Returns the folder."""
        extra = {"recipe": self.name, "loop": self.loop_state() if self.loop_state else {}}
        path = self.policy.save_checkpoint(self.out_dir, export=export, step=self.step,
                                           extra=extra)
        self._saved_step = self.step
        return path

    def stop_if_requested(self, last: bool = False) -> None:
        """At the end of every step, on every rank (collective): saves every
        ``training.ckpt_every_steps`` steps; on a signal or near ``training.max_time`` saves
        (no export) and raises :class:`~hybridtrain.training.preemption.Preempted`. No stop
        after the ``last`` step (the run finishes and saves anyway)."""
        ck, every = self.cfg.checkpoint.enabled, self.cfg.training.ckpt_every_steps
        if ck and every and self.step % every == 0 and not last:
            with self.stop.saving():
                self.save()
        if not self.stop.active or last:
            return
        if ck and self.stop.needs_timed_save():
            with self.stop.saving():  # training.max_time: how long a save takes
                self.save()
        reason = self.stop.requested()
        if reason is None:
            return
        where = "checkpoints are off (checkpoint.enabled: false): nothing was saved"
        if ck:
            path = os.path.join(self.out_dir, f"step_{self.step}")
            if self._saved_step != self.step:
                with self.stop.saving():
                    path = self.save()
            where = f"saved {path}"
        self.stop.restore()
        self.metrics.close()
        raise Preempted(f"{reason}: {self.name} stopped after step {self.step} of "
                        f"{self.steps}; {where}")

    def finish(self, headline: Callable[[list[dict]], str]) -> dict[str, Any]:
        """Final checkpoint with the export, ``loss.png``, the summary (printed by rank 0). As
        finetune's: a signal during the final save only waits for it (the step loop's handlers
        stay until it is done); the run has finished."""
        ckpt = None
        with self.stop.saving():
            if self.cfg.checkpoint.enabled:  # step_N: N = the logged steps (GRPO: rollouts)
                export = self.cfg.checkpoint.save_hf_at_end
                ckpt = self.save(export=export)
                if export:  # final/: the finished run's export, as finetune's
                    self.policy.checkpointer(self.out_dir).mark_final(ckpt)
        self.stop.restore()
        if self.stop.received:
            logger.warning("%s received after the last step: the run finished", ", ".join(
                sorted({signal.Signals(x).name for x in self.stop.received})))
        plot = self.metrics.close(export_dir=ckpt if self.cfg.checkpoint.save_hf_at_end else None)
        losses = [r["loss"] for r in self.history if math.isfinite(r.get("loss", math.nan))]
        summary = {"steps": len(self.history), "first_loss": losses[0] if losses else None,
                   "last_loss": losses[-1] if losses else None, "checkpoint": ckpt,
                   "loss_png": plot, "out_dir": self.out_dir,
                   "total_time_s": time.perf_counter() - self.t_start}
        if self.is_main:
            print(f"hybridtrain {self.name}: {headline(self.history)}\noutputs in "
                  f"{self.out_dir}/ (training.jsonl, loss.png"
                  + (f", {os.path.relpath(ckpt, self.out_dir)}/" if ckpt else "")
                  + (", final/" if os.path.islink(os.path.join(self.out_dir, "final")) else "")
                  + ")", flush=True)
        return summary


def mean_of(records: Sequence[dict], key: str) -> float | None:
    """The mean of the finite values of ``key`` (None when there is none)."""
    vals = [r[key] for r in records
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else None


def fmt(value: float | None, spec: str = ".3f") -> str:
    """A summary number, or ``n/a`` when there is none."""
    return "n/a" if value is None else format(value, spec)
