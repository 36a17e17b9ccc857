"""MetricsLogger: training.jsonl / validation.jsonl records and TensorBoard scalars."""

from __future__ import annotations

import math

import pytest
import torch

from hybridtrain.training.metrics import MetricsLogger, read_jsonl


def test_jsonl_and_tensorboard_records(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = MetricsLogger(str(tmp_path), tensorboard=True, progress=False, plot=False)
    m.open()
    m.log_train({"step": 1, "loss": torch.tensor(2.5), "grad_norm": math.inf, "lr": 1e-3})
    m.log_train({"step": 2, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "note": "x"})
    m.log_val({"step": 2, "val_loss": 2.25})
    m.close(plot=False)

    assert read_jsonl(str(tmp_path / "training.jsonl")) == [
        {"step": 1, "loss": 2.5, "grad_norm": None, "lr": 1e-3},
        {"step": 2, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "note": "x"},
    ]
    assert read_jsonl(str(tmp_path / "validation.jsonl")) == [{"step": 2, "val_loss": 2.25}]
    ev = EventAccumulator(str(tmp_path / "tb"))
    ev.Reload()
    assert set(ev.Tags()["scalars"]) == {"train/loss", "train/grad_norm", "train/lr", "val/val_loss"}
    assert [(e.step, e.value) for e in ev.Scalars("train/loss")] == [(1, 2.5), (2, 2.0)]
    assert [e.step for e in ev.Scalars("train/grad_norm")] == [2]  # non-finite: null, not logged
    assert [(e.step, e.value) for e in ev.Scalars("val/val_loss")] == [(2, 2.25)]


def test_other_ranks_write_nothing(tmp_path):
    m = MetricsLogger(str(tmp_path / "run"), is_main=False, progress=False, plot=False)
    m.open()
    m.log_train({"step": 1, "loss": 1.0})
    m.log_val({"step": 1, "val_loss": 1.0})
    m.close()
    assert not (tmp_path / "run").exists()


def test_validation_line_is_rounded_and_the_file_is_not(tmp_path, caplog):
    m = MetricsLogger(str(tmp_path), progress=False, plot=False)
    m.open()
    with caplog.at_level("INFO", logger="hybridtrain.training.metrics"):
        m.log_val({"step": 30, "val_loss": 6.270185196341914, "exact_match": 3.125})
    m.close(plot=False)
    assert "step 30: val_loss 6.2702, exact_match 3.1250" in caplog.text
    assert read_jsonl(str(tmp_path / "validation.jsonl"))[0]["val_loss"] == 6.270185196341914
