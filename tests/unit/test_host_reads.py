"""A training step outside a logging step reads nothing back from the device: the skip is
decided there, and loss / gradient norm come back a step later from a copy in host memory.

On CPU every tensor is a host tensor, so the test counts the operators that read a tensor's
values on the host (``aten._local_scalar_dense``: ``.item()`` / ``int()`` / ``float()``) or
whose output size depends on its values (``nonzero`` and what calls it: a device sync on CUDA),
with where they were called from. The only reads are named below with their reason."""

from __future__ import annotations

import dataclasses
import os
import time
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hybridtrain
from hybridtrain.ops import backend
from hybridtrain.training.lr_schedule import LRScheduler
from hybridtrain.training.optim import build_optimizer
from hybridtrain.training.trainer import TrainData, TrainStep
from tests.helpers.data import make_loader, sft_dataset
from tests.helpers.training import build_trainer

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
         aten.repeat_interleave.Tensor, aten._unique2.default, aten.unique_consecutive.default}

# callers whose reads are of the loader's host tensors before they move to the device
HOST_COUNTS = {"count_label_tokens": "the label-token count of the loader's host batch",
               "count_tokens": "the token count of the loader's host batch",
               "batch_flops": "the FLOPs of the loader's host batch (documents' lengths)"}
# the model's own reads, one per micro-batch each: whether a row holds several documents (the
# plain causal paths when not), and the label rows the chunked PyTorch loss keeps (the head GEMM's
# row count; Liger's fused loss, the CUDA default where installed, does not read it)
MODEL = {"sequence_info": "whether any row holds several documents",
         "_label_rows": "the label rows the chunked PyTorch loss keeps"}
# the eager packed attention and conv read their documents' boundaries, once per micro-batch
# (flash-attn varlen takes host lengths); compiled blocks read none
PACKED_EAGER = {"read_starts": "the documents' starts of packed rows, once per micro-batch (eager "
                               "per-document attention, the conv's restarts)",
                "seq_idx_from_cu_seqlens": "the check of the packed rows' cu_seqlens (an input)"}


# the package's own files (a path test: a checkout folder named hybridtrain holds the tests too)
PACKAGE = os.path.join(os.path.dirname(os.path.abspath(hybridtrain.__file__)), "")


class HostReads(TorchDispatchMode):
    """Records ``(op, the innermost hybridtrain function calling it)`` for each read."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) \
            and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if func in READS or bool_index:
            where = [f.name for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
            self.reads.append((str(func), where[-1] if where else "?"))
        return func(*args, **kwargs)


def _reads_per_step(trainer, steps: int = 3):
    """(the reads of each step, the steps' records)."""
    batches = trainer.sched.train_batches(lambda s: make_loader(trainer.data.train, s),
                                          len(trainer.data.train))
    out, records = [], []
    for _ in range(steps):
        micro = next(batches)
        with HostReads() as mode:
            records.append(trainer.step(micro))
        out.append(mode.reads)
    trainer.settle()
    return out, records


@pytest.mark.parametrize("path", ["dense", "moe_grouped", "packed"])
def test_a_step_reads_nothing_back_from_the_device(path, monkeypatch):
    kind = "dense" if path == "dense" else "mixed"
    from tests.helpers.models import tiny_model

    packed = sft_dataset(64, pack_size=24)
    trainer = build_trainer(None, max_steps=3, val=False, log_every=100,
                            model_fn=lambda seed=0: tiny_model(seed, kind),
                            n_train=len(packed) if path == "packed" else 64)
    if path == "moe_grouped":  # the experts' grouped GEMM, as on CUDA (here in fp32)
        monkeypatch.setattr(backend, "grouped_experts", lambda x, widths=(): True)
    if path == "packed":
        trainer.data = TrainData(packed, make_loader)
    allowed = HOST_COUNTS | MODEL | (PACKED_EAGER if path == "packed" else {})
    reads_per_step, records = _reads_per_step(trainer)
    for reads in reads_per_step:
        unnamed = [r for r in reads if r[1] not in allowed]
        assert unnamed == [], unnamed
    assert [r["skipped_steps"] for r in records] == [0, 0, 0]  # filled in a step late
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 for r in records)


class _NaNAt(TrainStep):
    """A train step whose ``bad``-th call returns a NaN loss sum."""

    def __init__(self, bad: int):
        super().__init__()
        self.calls, self.bad = 0, bad

    def __call__(self, model, micro_batches, n):
        self.calls += 1
        ce = super().__call__(model, micro_batches, n)
        return ce * float("nan") if self.calls == self.bad else ce


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_the_skip_on_the_device_and_on_the_host_agree(implementation):
    """The fused AdamW skips on the device flag; foreach reads it first: the same run."""
    tr = build_trainer(None, max_steps=4, val=False, train_step=_NaNAt(2), log_every=100)
    tr.optimizer = build_optimizer(tr.model, lr=3e-3, weight_decay=0.1, implementation=implementation)
    tr.lr_scheduler = LRScheduler(tr.optimizer, lr_decay_style="cosine", lr_warmup_steps=2,
                                  total_steps=4, min_lr=3e-4)
    tr.fit()
    hist = tr.history
    assert [r["skipped_steps"] for r in hist] == [0, 1, 1, 1]
    f = tr.lr_scheduler.lr_at
    assert [r["lr"] for r in hist] == [f(0), f(1), f(1), f(2)]
    assert tr.lr_scheduler.num_steps == 3
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    state = tr.optimizer.state[next(iter(tr.model.parameters()))]
    assert float(state["step"]) == 3  # the skipped update did not count


def test_logging_steps_are_timed_over_their_window():
    """A logging step reports the rates of the steps since the previous one, not its own host
    time (where the host runs ahead, CUDA, its own time is not the device's), on every device."""
    tr = build_trainer(None, max_steps=4, val=False, log_every=2)
    tr.fit()
    log = [tr.history[1], tr.history[3]]
    for i, rec in zip((0, 2), log):
        tokens = tr.history[i]["num_tokens"] + rec["num_tokens"]
        assert rec["tps"] == pytest.approx(tokens / (2 * rec["step_time_s"]))


def test_a_steps_time_holds_its_loaders_time():
    """``step_time_s`` is wall time from step end to step end, as other trainers clock it: the
    loader's time of a step (here 0.2 s for each global batch) is in it, from the second step
    on (the first step's window opens as the step starts, after its batch is loaded)."""
    tr = build_trainer(None, max_steps=3, val=False)
    loader = tr.data.make_loader

    def slow_loader(dataset, sampler):
        for batch in loader(dataset, sampler):
            time.sleep(0.1)  # two micro-batches a global batch
            yield batch

    tr.data = dataclasses.replace(tr.data, make_loader=slow_loader)
    tr.fit()
    times = [r["step_time_s"] for r in tr.history]
    assert min(times[1:]) >= 0.2, times
