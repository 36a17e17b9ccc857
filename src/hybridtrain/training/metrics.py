"""Run metrics: ``training.jsonl`` / ``validation.jsonl``, optional TensorBoard, Weights & Biases
and MLflow (training/trackers.py), a tqdm progress bar and ``loss.png``. Only the main rank
writes; other ranks get a logger that does nothing."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from collections.abc import Sequence
from typing import Any

import torch
import yaml

from hybridtrain.fileio import append_text, atomic_write
from hybridtrain.fileio import read_jsonl as fileio_read_jsonl
from hybridtrain.fileio import text_reader
from hybridtrain.training.trackers import (
    GuardedTracker, TrackerSettings, make_trackers, numbers, split_val_record, tracker_names,
)

logger = logging.getLogger(__name__)

TRAIN_FIELDS = (
    "step", "loss", "grad_norm", "lr", "num_label_tokens", "num_tokens", "tps", "tps_per_device",
    "tflops_per_device", "mfu", "mem_gb", "consumed_samples", "skipped_steps",
)


def peak_memory_gb(device: torch.device | None = None) -> float:
    """Peak accelerator memory allocated on ``device`` (CUDA), else the process' peak RSS."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kb / 2**20


def _clean(v: Any) -> Any:
    """JSON-safe scalars (non-finite floats become null)."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


@text_reader("jsonl")
def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    return fileio_read_jsonl(path)


def _truncate_jsonl(path: str, max_step: int) -> None:
    """Drops the records after ``max_step`` (left by a run that crashed after its last
    checkpoint), so a resumed run's files read as one run."""
    if not os.path.exists(path):
        return
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= max_step]
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept))


# validation.jsonl keys repeated on the log line (the file keeps every key, full precision)
_VAL_LINE_KEYS = ("val_loss", "val_accuracy", "answer_accuracy", "exact_match", "f1")


def _short(value: Any) -> str:
    """A log line's number: 4 decimals (a float), else as is."""
    return f"{value:.4f}" if isinstance(value, float) else str(value)


class MetricsLogger:
    """Writes the run's metrics. :meth:`open` (called by the trainer at the start of ``fit``)
    starts fresh files, or, on a resumed run, drops records past the resumed step."""

    def __init__(
        self,
        out_dir: str,
        is_main: bool = True,
        tensorboard: bool = False,
        tensorboard_dir: str | None = None,
        progress: bool = True,
        jsonl: bool = True,
        plot: bool = True,
        plot_extra: Sequence[str] = (),
        loss_label: str = "loss (token-weighted cross-entropy)",
        trackers: Sequence[GuardedTracker] = (),
    ):
        self.out_dir = out_dir
        self.is_main = is_main
        self.train_path = os.path.join(out_dir, "training.jsonl")
        self.val_path = os.path.join(out_dir, "validation.jsonl")
        self.tensorboard = tensorboard
        self.tensorboard_dir = tensorboard_dir or os.path.join(out_dir, "tb")
        self.show_progress = progress
        self.jsonl = jsonl
        self.plot = plot
        self.plot_extra = tuple(plot_extra)
        self.loss_label = loss_label
        self.trackers = tuple(trackers) if is_main else ()
        self._tb = None
        self._bar = None
        self._redirect = None

    def open(self, start_step: int = 0, total_steps: int | None = None) -> None:
        if not self.is_main:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        if start_step > 0:
            _truncate_jsonl(self.train_path, start_step)
            _truncate_jsonl(self.val_path, start_step)
        else:  # a fresh run starts fresh files
            for p in (self.train_path, self.val_path):
                if os.path.exists(p):
                    os.remove(p)
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("tensorboard is not installed (pip install 'hybridtrain[tb]'); "
                               "TensorBoard logging is off")
            else:
                self._tb = SummaryWriter(self.tensorboard_dir, purge_step=start_step + 1)
        for tracker in self.trackers:
            tracker.start(resumed=start_step > 0)
        if self.show_progress:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr)
            self._redirect = logging_redirect_tqdm()  # log lines go above the bar
            self._redirect.__enter__()

    def _append(self, path: str, record: dict) -> None:
        if not self.jsonl:
            return
        append_text(path, json.dumps(record) + "\n")

    def _write(self, path: str, tb_prefix: str, record: dict[str, Any]) -> dict[str, Any]:
        """Appends the JSON-safe ``record`` to ``path`` and its numbers to TensorBoard."""
        record = {k: _clean(v) for k, v in record.items()}
        self._append(path, record)
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{tb_prefix}/{k}", v, record["step"])
        return record

    def _track(self, values: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.call("log", values, step)

    def log_train(self, record: dict[str, Any]) -> None:
        if self.is_main:
            record = self._write(self.train_path, "train", record)
            self._track(numbers(record), record["step"])

    def log_val(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        record = self._write(self.val_path, "val", record)
        self._track(split_val_record(record), record["step"])
        msg = f"step {record['step']}: " + ", ".join(
            f"{k} {_short(record[k])}" for k in _VAL_LINE_KEYS if record.get(k) is not None)
        if self._bar is not None:
            self._bar.write(msg)
        else:
            logger.info(msg)

    def progress(self, step: int, loss: float | None, lr: float, tps: float | None,
                 extra: dict[str, float | None] | None = None) -> None:
        """The bar's line: ``loss``, ``extra`` losses (e.g. ``mtp_loss``), ``lr``, tokens/s."""
        if self._bar is None:
            return
        post = {"lr": f"{lr:.2e}"}
        if loss is not None:
            post["loss"] = f"{loss:.4f}"
        for k, v in (extra or {}).items():
            if v is not None:
                post[k] = f"{v:.4f}"
        if tps is not None:
            post["tok/s"] = f"{tps:,.0f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self, plot: bool | None = None, export_dir: str | None = None) -> str | None:
        """Closes the bar, TensorBoard and the trackers (handing them the finished run's
        ``export_dir`` first); writes ``loss.png``; returns its path (or None)."""
        if not self.is_main:
            return None
        for tracker in self.trackers:
            if export_dir is not None:
                tracker.call("log_export", export_dir)
            tracker.finish()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not (self.plot if plot is None else plot):
            return None
        return plot_losses(self.out_dir, self.plot_extra, self.loss_label)


def metrics_logger(cfg: Any, out_dir: str, is_main: bool, **options: Any) -> MetricsLogger:
    """The :class:`MetricsLogger` of a loaded recipe's ``metrics`` section (``options``: the
    recipe's own plot panels and loss label)."""
    m = cfg.metrics
    names = tracker_names(m) if is_main else []
    trackers = make_trackers(names, out_dir, TrackerSettings(
        project=m.project, run_name=m.run_name, tags=tuple(m.tags),
        mlflow_tracking_uri=m.mlflow_tracking_uri, on_error=m.tracker_on_error,
        config=yaml.safe_load(cfg.to_yaml()) if names else {}))
    return MetricsLogger(out_dir, is_main=is_main, tensorboard=m.tensorboard,
                         tensorboard_dir=m.tensorboard_dir, progress=m.progress_bar,
                         jsonl=m.jsonl, plot=m.plot, trackers=trackers, **options)


def plot_losses(out_dir: str, extra: Sequence[str] = (),
                loss_label: str = "loss (token-weighted cross-entropy)") -> str | None:
    """Writes ``out_dir/loss.png`` (train and val loss against step) with matplotlib; each
    ``extra`` key of ``training.jsonl`` (e.g. a reward) in a panel of its own below, with the
    ``val_<key>`` of ``validation.jsonl`` when there is one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed (pip install 'hybridtrain[plot]'); "
                    "skipping loss.png")
        return None
    train = [r for r in read_jsonl(os.path.join(out_dir, "training.jsonl"))
             if r.get("loss") is not None]
    val = [r for r in read_jsonl(os.path.join(out_dir, "validation.jsonl"))
           if r.get("val_loss") is not None]
    fig, axes = plt.subplots(1 + len(extra), 1, figsize=(7, 4.5 + 3 * len(extra)), squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel(loss_label)
    ax.grid(alpha=0.3)
    ax.legend()
    for key, sub in zip(extra, axes[1:, 0]):
        pts = [r for r in train if isinstance(r.get(key), (int, float))]
        sub.plot([r["step"] for r in pts], [r[key] for r in pts], label="train")
        vpts = [r for r in val if isinstance(r.get(f"val_{key}"), (int, float))]
        if vpts:
            sub.plot([r["step"] for r in vpts], [r[f"val_{key}"] for r in vpts], "o-",
                     label="validation")
        sub.set_xlabel("step")
        sub.set_ylabel(key)
        sub.grid(alpha=0.3)
        sub.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "loss.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
