"""Experiment trackers fed by :class:`~hybridtrain.training.metrics.MetricsLogger` on the main
rank: Weights & Biases (``metrics.wandb``) and MLflow (``metrics.mlflow``), each from its
optional extra.

Names: a training step's metrics go in under the names of ``training.jsonl``; a validation's
under ``val/<name of validation.jsonl>`` and the answers it generated under
``eval/<name>`` (their own panels). The x-axis is the optimizer step.

A tracker never stops a run once it has started: an exception while logging is caught, said once
and the tracker is off for the rest of the run (the JSONL files stay complete). One that cannot
start (package missing, server down) is a warning, or with ``metrics.tracker_on_error: raise`` an
error before the first step. A resumed run continues the same tracker run: its id is kept in the
run folder (``wandb_run_id``, ``mlflow_run_id``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# keys of validation.jsonl written by the generation evaluator (training/evaluation.py)
EVAL_KEYS = frozenset({"exact_match", "f1", "eval_examples", "eval_new_tokens", "eval_time_s"})
_EXPORT_FOLDERS = ("hf", "adapter", "merged_hf")  # inside an export folder (checkpoint.py)
_MLFLOW_PARAM_BATCH = 100  # MLflow's limit of params per log_batch
_MLFLOW_PARAM_CHARS = 6000  # MLflow's limit of a param value


class TrackerUnavailable(ValueError):
    """A tracker the recipe asks for cannot start (with ``tracker_on_error: raise``)."""


@dataclass(frozen=True)
class TrackerSettings:
    """The tracker keys of the recipe's ``metrics`` section."""

    project: str | None = None
    run_name: str | None = None
    tags: Sequence[str] = ()
    mlflow_tracking_uri: str | None = None
    on_error: str = "warn"
    config: Mapping[str, Any] = field(default_factory=dict)  # the resolved recipe


def tracker_names(metrics_section: Any) -> list[str]:
    """The trackers a recipe's ``metrics`` section turns on."""
    return [name for name in ("wandb", "mlflow") if getattr(metrics_section, name)]


def split_val_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A validation record's numbers under their panel names (``val/...``, ``eval/...``)."""
    return {f"{'eval' if k in EVAL_KEYS else 'val'}/{k}": v for k, v in numbers(record).items()}


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a JSON-safe record, without ``step`` (nulls and strings left out)."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, leaf)`` pairs of nested mappings (lists stay leaves)."""
    if isinstance(tree, Mapping) and tree:
        for k, v in tree.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif prefix:
        yield prefix, tree


class Tracker:
    """One tracker's run. ``start`` may raise (the package missing, the server down);
    :class:`GuardedTracker` turns every failure into a warning or a refusal."""

    name = ""
    extra = ""  # the pyproject extra that installs it

    def __init__(self, out_dir: str, settings: TrackerSettings):
        self.out_dir = out_dir
        self.settings = settings
        self.id_path = os.path.join(out_dir, f"{self.name}_run_id")

    def stored_run_id(self, resumed: bool) -> str | None:
        """The run id kept in the run folder by the run that is being resumed."""
        if not (resumed and os.path.exists(self.id_path)):
            return None
        with open(self.id_path) as f:
            return f.read().strip() or None

    def store_run_id(self, run_id: str) -> None:
        from hybridtrain.fileio import atomic_write

        atomic_write(self.id_path, run_id + "\n")

    def start(self, resumed: bool) -> None:
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_export(self, export_dir: str) -> None:
        """The finished run's HF export / adapter (a folder holding ``hf/`` or ``adapter/``)."""

    def finish(self) -> None:
        raise NotImplementedError


class WandbTracker(Tracker):
    """Weights & Biases: ``wandb.init`` with the recipe as config; the library's own environment
    variables (``WANDB_MODE``, ``WANDB_DIR``, ``WANDB_PROJECT``, ``WANDB_API_KEY``...) apply."""

    name, extra = "wandb", "wandb"

    def start(self, resumed: bool) -> None:
        import wandb

        s = self.settings
        project = s.project or os.environ.get("WANDB_PROJECT") or "hybridtrain"
        self.run = wandb.init(
            project=project, name=s.run_name, tags=list(s.tags) or None, config=dict(s.config),
            id=self.stored_run_id(resumed), resume="allow",
            dir=None if os.environ.get("WANDB_DIR") else self.out_dir)
        self.run.define_metric("step", hidden=True)
        self.run.define_metric("*", step_metric="step")  # the optimizer step is the x-axis
        self.store_run_id(self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({"step": step, **metrics})

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """MLflow through ``MlflowClient`` (no global state): the flattened recipe as params,
    metrics per step, the export as an artifact. The default store is an SQLite file in the run
    folder, its artifacts next to it (``mlartifacts/``)."""

    name, extra = "mlflow", "mlflow"

    def start(self, resumed: bool) -> None:
        from mlflow import MlflowClient

        s = self.settings
        local = s.mlflow_tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI")
        uri = (f"sqlite:///{os.path.abspath(self.out_dir)}/mlflow.db" if local
               else s.mlflow_tracking_uri or os.environ["MLFLOW_TRACKING_URI"])
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = self.stored_run_id(resumed)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = s.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "hybridtrain"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else (
            self.client.create_experiment(name, artifact_location=(
                f"file://{os.path.abspath(self.out_dir)}/mlartifacts" if local else None)))
        run = self.client.create_run(experiment_id, run_name=s.run_name,
                                     tags={t: "" for t in s.tags})
        self.run_id = run.info.run_id
        self._log_params()
        self.store_run_id(self.run_id)

    def _log_params(self) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:_MLFLOW_PARAM_CHARS]) for k, v in flatten(self.settings.config)]
        for i in range(0, len(params), _MLFLOW_PARAM_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _MLFLOW_PARAM_BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_export(self, export_dir: str) -> None:
        for sub in _EXPORT_FOLDERS:
            path = os.path.join(export_dir, sub)
            if os.path.isdir(path):
                self.client.log_artifacts(self.run_id, path, artifact_path=sub)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (WandbTracker, MlflowTracker)}


class GuardedTracker:
    """A :class:`Tracker` whose failures never reach the run: one that cannot start is a warning
    (or :class:`TrackerUnavailable` with ``on_error: raise``); one that fails later is said once
    and switched off."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.active = False

    def start(self, resumed: bool) -> None:
        t = self.tracker
        try:
            t.start(resumed)
        except ImportError as e:
            self._refuse(f"metrics.{t.name}: the {t.name} package is not installed ({e}); "
                         f"pip install 'hybridtrain[{t.extra}]', or set metrics.{t.name}: false")
        except Exception as e:  # the tracker's own errors: a server down, a bad URI, no key
            self._refuse(f"metrics.{t.name}: {t.name} could not start: {type(e).__name__}: {e}")
        else:
            self.active = True

    def _refuse(self, message: str) -> None:
        if self.tracker.settings.on_error == "raise":
            raise TrackerUnavailable(
                message + " (metrics.tracker_on_error: warn goes on without it)") from None
        logger.warning("%s; training goes on without it (training.jsonl is complete)", message)

    def call(self, method: str, *args: Any) -> None:
        """``tracker.method(*args)``, unless off; a failure switches the tracker off."""
        if not self.active:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as e:  # never let a tracker stop the run
            self.active = False
            logger.warning("%s failed in %s (%s: %s); %s logging is off for the rest of the run "
                           "(training.jsonl and validation.jsonl stay complete)",
                           self.tracker.name, method, type(e).__name__, e, self.tracker.name)
            if method != "finish":
                try:
                    self.tracker.finish()
                except Exception:  # already failing: the warning above said so
                    pass

    def finish(self) -> None:
        self.call("finish")
        self.active = False


def make_trackers(names: Sequence[str], out_dir: str,
                  settings: TrackerSettings) -> list[GuardedTracker]:
    return [GuardedTracker(TRACKERS[n](out_dir, settings)) for n in names]
