"""What the RL recipes (``dpo``, ``grpo``) share: the run folder, the trained Policy and its frozen
reference, the step log (``training.jsonl``, progress bar, ``loss.png`` with the recipe's own
curves), the final checkpoint with its export, and the summary."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridtrain.config import ConfigNode
from hybridtrain.fileio import atomic_write
from hybridtrain.runfolder import run_folder_path
from hybridtrain.training.metrics import MetricsLogger
from hybridtrain.training.preemption import Preempted, RunStop

logger = logging.getLogger(__name__)


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
    ``checkpoint.dir``. A new run there replaces an earlier one only with
    ``checkpoint.overwrite`` (RL runs do not resume). Stops early, with a checkpoint, on a signal
    or near ``training.max_time`` (:meth:`stop_if_requested`, called after every step)."""

    def __init__(self, cfg: ConfigNode, name: str, plot_extra: Sequence[str] = (),
                 loss_label: str = "loss"):
        from hybridtrain.recipes.finetune import _check_run_folder
        from hybridtrain.rl import Policy
        from hybridtrain.training.builder import check_input_paths

        self.cfg, self.name = cfg, name
        self.out_dir = run_folder_path(cfg.checkpoint.dir)
        self.t_start = time.perf_counter()
        _, clear = _check_run_folder(cfg, self.out_dir)
        check_input_paths(cfg)  # before two models are built
        self.policy = Policy(cfg)
        t0 = time.perf_counter()
        with _info_lines_off():  # the same build again: its log would repeat the policy's
            self.reference = Policy(cfg)  # never trained: the reference policy
        logger.info("reference policy: the recipe's model built again and kept frozen (%.1fs)",
                    time.perf_counter() - t0)
        self.is_main = self.policy.built.is_main
        if clear:
            self.policy.checkpointer(self.out_dir).clear()
        m = cfg.metrics
        self.metrics = MetricsLogger(self.out_dir, is_main=self.is_main, tensorboard=m.tensorboard,
                                     tensorboard_dir=m.tensorboard_dir, progress=m.progress_bar,
                                     jsonl=m.jsonl, plot=m.plot, plot_extra=plot_extra,
                                     loss_label=loss_label)
        self.metrics.open(0, cfg.training.max_steps)
        if self.is_main:
            os.makedirs(self.out_dir, exist_ok=True)
            atomic_write(os.path.join(self.out_dir, "config.yaml"), cfg.to_yaml())
        self.history: list[dict] = []
        self.val_history: list[dict] = []
        self.stop = RunStop.from_config(cfg, self.policy.device, self.t_start)
        self.stop.install()  # until finish() or the early stop

    def train(self, batch: dict, loss_fn, cause: str | None = None, **kwargs) -> dict[str, Any]:
        """``policy.train``; a run that the skipped-update limit stops closes its logs first and
        names ``cause`` (what the recipe knows made the updates non-finite) in its error."""
        from hybridtrain.training.trainer import TrainingDiverged

        try:
            return self.policy.train(batch, loss_fn, **kwargs)
        except TrainingDiverged as e:
            self.metrics.close()
            raise TrainingDiverged(f"{e}" + (f". First cause: {cause}" if cause else "")) from None

    def log_val(self, rec: dict[str, Any]) -> None:
        self.val_history.append(rec)
        self.metrics.log_val(rec)

    def log(self, rec: dict[str, Any]) -> None:
        self.history.append(rec)
        self.metrics.log_train(rec)
        self.metrics.progress(rec["step"], rec.get("loss"), rec.get("lr", 0.0), None)

    def stop_if_requested(self, last: bool = False) -> None:
        """At the end of every step, on every rank (collective): on a signal or near
        ``training.max_time`` saves the Policy (``step_{N}``, N its optimizer updates; no
        export) and raises :class:`~hybridtrain.training.preemption.Preempted`. Nothing after
        the ``last`` step (the run finishes and saves anyway)."""
        if not self.stop.active or last:
            return
        ck = self.cfg.checkpoint.enabled
        if ck and self.stop.needs_timed_save():
            with self.stop.saving():  # training.max_time: how long a save takes
                self.policy.save_checkpoint(self.out_dir)
        reason = self.stop.requested()
        if reason is None:
            return
        where = "checkpoints are off (checkpoint.enabled: false): nothing was saved"
        if ck:
            with self.stop.saving():
                where = f"saved {self.policy.save_checkpoint(self.out_dir)}"
        self.stop.restore()
        self.metrics.close()
        raise Preempted(f"{reason}: {self.name} stopped after step {len(self.history)} of "
                        f"{self.cfg.training.max_steps}; {where}")

    def finish(self, headline: Callable[[list[dict]], str]) -> dict[str, Any]:
        """Final checkpoint with the export, ``loss.png``, the summary (printed by rank 0)."""
        self.stop.restore()
        ckpt = None
        if self.cfg.checkpoint.enabled:  # step_N: N = the logged steps (GRPO: rollout steps)
            step = self.history[-1]["step"] if self.history else self.policy.step
            export = self.cfg.checkpoint.save_hf_at_end
            ckpt = self.policy.save_checkpoint(self.out_dir, export=export, step=step)
            if export:  # final/: the finished run's export, as finetune's
                self.policy.checkpointer(self.out_dir).mark_final(ckpt)
        plot = self.metrics.close()
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
