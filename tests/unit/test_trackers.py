"""Weights & Biases and MLflow (metrics.wandb / metrics.mlflow), offline, with the real packages:
a tiny run and its resume read back from W&B's offline run files and MLflow's SQLite store."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tests.helpers.recipes import tiny_recipe

from hybridtrain.config import build_config
from hybridtrain.training.metrics import TRAIN_FIELDS, MetricsLogger, read_jsonl
from hybridtrain.training.trackers import (
    GuardedTracker, Tracker, TrackerSettings, TrackerUnavailable,
)


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B offline run file (LevelDB log framing: 32 KiB blocks,
    7-byte headers, after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, parts, out = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the rest of the block is padding
            pos += left
            continue
        parts = (b"" if kind in (1, 2) else parts) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def _wandb_run(run_dir: Path) -> tuple[object, list[dict]]:
    """(the run record, the history rows) of one offline run folder."""
    records = _wandb_records(next(run_dir.glob("run-*.wandb")))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    return run, rows


def _run(tmp_path: Path, steps: int, resume: str, **metrics) -> Path:
    from hybridtrain.recipes.finetune import run

    out = tmp_path / "run"
    cfg = build_config(tiny_recipe(
        dataset={"n": 16},
        training={"max_steps": steps, "val_every_steps": 2, "ckpt_every_steps": 2},
        validation_dataset={"_target_": "tests.helpers.data.sft_dataset", "n": 4,
                            "vocab_size": 256, "seed": 7},
        checkpoint={"dir": str(out), "resume": resume},
        metrics={"wandb": True, "mlflow": True, "project": "tiny", "run_name": "first",
                 "tags": ["ci", "tiny"], **metrics}), allowed_target_prefixes=["tests."])
    run(cfg)
    return out


def test_wandb_and_mlflow_follow_a_run_and_its_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_PROJECT", "WANDB_NAME", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    out = _run(tmp_path, 2, "null")
    _run(tmp_path, 3, "auto")  # resumed: the same tracker runs go on

    jsonl = read_jsonl(str(out / "training.jsonl"))
    assert [r["step"] for r in jsonl] == [1, 2, 3]

    # W&B: two offline folders (the run and its resume) of one run id
    runs = sorted((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    (first, rows1), (second, rows2) = _wandb_run(runs[0]), _wandb_run(runs[1])
    assert first.run_id == second.run_id == (out / "wandb_run_id").read_text().strip()
    assert (first.project, first.display_name, list(first.tags)) == ("tiny", "first",
                                                                       ["ci", "tiny"])
    config = {u.key: json.loads(u.value_json) for u in first.config.update}
    assert config["training"]["max_steps"] == 2 and config["metrics"]["wandb"] is True
    train_rows = [r for r in rows1 + rows2 if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    numeric = {k for r in jsonl for k, v in r.items() if isinstance(v, (int, float))} - {"step"}
    assert set(TRAIN_FIELDS) - {"step"} <= numeric
    for row, rec in zip(train_rows, jsonl):  # the names and values of training.jsonl
        assert {k: row[k] for k in numeric if k in rec and rec[k] is not None} == {
            k: rec[k] for k in numeric if k in rec and rec[k] is not None}
    val_rows = [r for r in rows1 + rows2 if "val/val_loss" in r]
    vals = read_jsonl(str(out / "validation.jsonl"))
    assert [(r["step"], r["val/val_loss"]) for r in val_rows] == [
        (v["step"], v["val_loss"]) for v in vals]

    # MLflow: one run in the run folder's SQLite store; params, per-step metrics, the export
    client = MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    run_id = (out / "mlflow_run_id").read_text().strip()
    ml = client.get_run(run_id)
    assert ml.info.run_name == "first" and ml.info.status == "FINISHED"
    assert {"ci", "tiny"} <= set(ml.data.tags)
    assert ml.data.params["training.max_steps"] == "2"  # the recipe the run started with
    assert ml.data.params["model.config.kind"] == "mixed"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in jsonl]
    assert [m.step for m in client.get_metric_history(run_id, "val/val_loss")] == [
        v["step"] for v in vals]
    assert client.get_experiment(ml.info.experiment_id).name == "tiny"
    artifacts = {a.path for a in client.list_artifacts(run_id, "hf")}
    assert "hf/model.safetensors" in artifacts and "hf/config.json" in artifacts


class _Broken(Tracker):
    """A tracker that starts and then fails at its second log call."""

    name, extra = "broken", "broken"

    def start(self, resumed):
        self.calls = 0

    def log(self, metrics, step):
        self.calls += 1
        if self.calls == 2:
            raise ConnectionError("server went away")

    def finish(self):
        pass


class _Unreachable(_Broken):
    def start(self, resumed):
        raise ConnectionError("http://mlflow.invalid: connection refused")


def test_a_tracker_failing_midway_is_switched_off_once_and_jsonl_stays_complete(tmp_path,
                                                                                 caplog):
    tracker = _Broken(str(tmp_path), TrackerSettings())
    m = MetricsLogger(str(tmp_path), progress=False, plot=False,
                      trackers=[GuardedTracker(tracker)])
    m.open()
    with caplog.at_level("WARNING"):
        for step in (1, 2, 3, 4):
            m.log_train({"step": step, "loss": 1.0 / step})
        m.log_val({"step": 4, "val_loss": 0.5, "exact_match": 50.0})
    m.close(plot=False)
    assert tracker.calls == 2  # off after its failure
    assert caplog.text.count("server went away") == 1
    assert "logging is off for the rest of the run" in caplog.text
    assert [r["step"] for r in read_jsonl(str(tmp_path / "training.jsonl"))] == [1, 2, 3, 4]


def test_a_tracker_that_cannot_start_warns_or_raises_as_chosen(tmp_path, caplog):
    for on_error in ("warn", "raise"):
        guarded = GuardedTracker(_Unreachable(str(tmp_path), TrackerSettings(on_error=on_error)))
        m = MetricsLogger(str(tmp_path), progress=False, plot=False, trackers=[guarded])
        if on_error == "raise":
            with pytest.raises(TrackerUnavailable, match="connection refused.*tracker_on_error"):
                m.open()
            continue
        with caplog.at_level("WARNING"):
            m.open()
            m.log_train({"step": 1, "loss": 1.0})
        m.close(plot=False)
        assert "broken could not start" in caplog.text and "goes on without it" in caplog.text
        assert read_jsonl(str(tmp_path / "training.jsonl")) == [{"step": 1, "loss": 1.0}]


def test_a_missing_package_names_the_extra(tmp_path, monkeypatch):
    import sys

    from hybridtrain.training.trackers import MlflowTracker

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    guarded = GuardedTracker(MlflowTracker(str(tmp_path), TrackerSettings(on_error="raise")))
    with pytest.raises(TrackerUnavailable, match=r"pip install 'hybridtrain\[mlflow\]'"):
        guarded.start(resumed=False)


def test_validation_and_evaluation_go_to_their_own_panels():
    from hybridtrain.training.trackers import split_val_record

    record = {"step": 4, "val_loss": 0.5, "val_ppl": None, "exact_match": 50.0, "f1": 61.0,
              "eval_time_s": 1.5, "time_s": 0.2}
    assert split_val_record(record) == {"val/val_loss": 0.5, "val/time_s": 0.2,
                                        "eval/exact_match": 50.0, "eval/f1": 61.0,
                                        "eval/eval_time_s": 1.5}
