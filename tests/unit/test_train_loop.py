"""Training-loop exactness: gradient accumulation, non-finite skipping, bitwise resume."""

import json
import math
import os

import pytest
import torch
from train_helpers import SyntheticDataset, build_trainer, collate, tiny_model

from hybridtrain.training.optim import build_optimizer, is_no_decay
from hybridtrain.training.trainer import TrainStep, loss_sum


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grad_accumulation_matches_one_big_batch():
    """4 micro-batches of 2 == 1 batch of 8 (uneven label counts per micro-batch), fp32."""
    ds = SyntheticDataset(8, seed=5)
    items = [ds[i] for i in range(8)]
    counts = [int((it["labels"] != -100).sum()) for it in items]
    assert len({sum(counts[i:i + 2]) for i in range(0, 8, 2)}) > 1  # really uneven
    step = TrainStep(chunk_size=7)
    results = []
    for mbs in (2, 8):
        model = tiny_model(0)
        micro = [collate(items[i:i + mbs]) for i in range(0, 8, mbs)]
        total = sum(int((m["labels"] != -100).sum()) for m in micro)
        ce = step(model, micro, total)
        results.append((float(ce) / total, _grads(model)))
    (loss_a, g_a), (loss_b, g_b) = results
    assert abs(loss_a - loss_b) <= 1e-6 * abs(loss_b)
    assert g_a.keys() == g_b.keys() and g_a
    for name in g_a:
        assert (g_a[name] - g_b[name]).abs().max() <= 1e-6, name


def test_grad_accumulation_through_the_trainer(tmp_path):
    """Same per-step losses and weights for micro_batch_size 2 (grad-acc 4) and 8 (no acc)."""
    runs = []
    for mbs in (2, 8):
        tr = build_trainer(None, max_steps=4, mbs=mbs, val=False)
        tr.fit()
        runs.append(([r["loss"] for r in tr.history], tr.model.state_dict()))
    (la, wa), (lb, wb) = runs
    assert la == pytest.approx(lb, rel=1e-6, abs=0)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=2e-6)


def test_loss_is_token_weighted_mean():
    model = tiny_model(0)
    ds = SyntheticDataset(4, seed=2)
    batch = collate([ds[i] for i in range(4)])
    with torch.no_grad():
        ce = loss_sum(model, batch, chunk_size=None)
        logits = model(batch["input_ids"])
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                batch["labels"].reshape(-1), reduction="sum")
    torch.testing.assert_close(ce, ref, rtol=1e-6, atol=1e-5)


class NaNAt(TrainStep):
    """Returns a NaN loss on the micro-batches of one step."""

    def __init__(self, bad_step, **kw):
        super().__init__(chunk_size=16, **kw)
        self.bad_step, self.calls = bad_step, 0

    def __call__(self, model, micro_batches, n):
        self.calls += 1
        if self.calls == self.bad_step:
            base = self.loss_fn
            self.loss_fn = lambda m, b: base(m, b) * float("nan")
            try:
                return super().__call__(model, micro_batches, n)
            finally:
                self.loss_fn = base
        return super().__call__(model, micro_batches, n)


def test_nan_step_is_skipped_and_lr_does_not_advance(tmp_path):
    tr = build_trainer(str(tmp_path), max_steps=8, train_step=NaNAt(5), ckpt_every=None)
    summary = tr.fit()
    hist = tr.history
    assert summary["steps"] == 8 and summary["skipped_steps"] == 1
    assert math.isnan(hist[4]["loss"]) and hist[4]["skipped_steps"] == 1
    assert hist[3]["skipped_steps"] == 0 and hist[7]["skipped_steps"] == 1
    # the skipped step's LR is used again by the next step: the schedule did not advance
    f = tr.lr_scheduler.lr_at
    assert [r["lr"] for r in hist] == [f(0), f(1), f(2), f(3), f(4), f(4), f(5), f(6)]
    assert f(3) != f(4) != f(5)
    assert tr.lr_scheduler.num_steps == 7
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(hist) if i != 4)
    recs = [json.loads(line) for line in open(tmp_path / "training.jsonl")]
    assert recs[4]["loss"] is None and recs[4]["skipped_steps"] == 1  # NaN written as null
    assert [r["consumed_samples"] for r in recs] == [8 * i for i in range(1, 9)]


def test_zero_label_batch_is_skipped():
    tr = build_trainer(None, max_steps=2, val=False)
    mb = collate([tr.train_dataset[i] for i in range(2)])
    mb["labels"][:] = -100
    rec = tr.train_one_step([mb] * 4)
    assert rec["num_label_tokens"] == 0 and rec["skipped_steps"] == 1
    assert tr.lr_scheduler.num_steps == 0


class CrashAt(TrainStep):
    def __init__(self, crash_step):
        super().__init__(chunk_size=16)
        self.crash_step, self.calls = crash_step, 0

    def __call__(self, model, micro_batches, n):
        self.calls += 1
        if self.calls == self.crash_step:
            raise KeyboardInterrupt("killed")
        return super().__call__(model, micro_batches, n)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resume_is_bitwise(tmp_path):
    ref = build_trainer(str(tmp_path / "ref"), max_steps=8, ckpt_every=4)
    ref.fit()
    ref_losses = [r["loss"] for r in ref.history]

    run = tmp_path / "run"
    first = build_trainer(str(run), max_steps=8, ckpt_every=4, train_step=CrashAt(6))
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    assert open(run / "latest").read().strip() == "step_4"
    second = build_trainer(str(run), max_steps=8, ckpt_every=4, seed=0)
    second.resume(second.checkpointer.resolve_resume("auto"))
    assert second.sched.step == 4 and second.lr_scheduler.num_steps == 4
    second.fit()
    losses = [r["loss"] for r in first.history[:4]] + [r["loss"] for r in second.history]
    assert losses == ref_losses  # bitwise
    wa, wb = _weights(ref.model), _weights(second.model)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # optimizer state too
    sa, sb = ref.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    # the jsonl reads as one uninterrupted run (records of the dead steps 5 were dropped)
    recs = [json.loads(line) for line in open(run / "training.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r["loss"] for r in recs] == ref_losses
    vals = [json.loads(line)["step"] for line in open(run / "validation.jsonl")]
    assert vals == [4, 8]


@pytest.mark.parametrize("where", ["dcp", "state", "rename", "latest"])
def test_crash_while_checkpointing_keeps_previous(tmp_path, monkeypatch, where):
    import hybridtrain.training.checkpoint as ck

    ref = build_trainer(str(tmp_path / "ref"), max_steps=8, ckpt_every=4, val=False)
    ref.fit()
    run = tmp_path / "run"
    tr = build_trainer(str(run), max_steps=8, ckpt_every=4, val=False)

    class Boom(RuntimeError):
        pass

    calls = {"n": 0}
    if where == "dcp":
        real = ck.dcp.save  # called through _dcp_save

        def bad_save(sd, **kw):
            calls["n"] += 1
            if calls["n"] == 2:  # the step-8 checkpoint: write half of it, then die
                real({k: v for i, (k, v) in enumerate(sd.items()) if i % 2}, **kw)
                raise Boom()
            return real(sd, **kw)

        monkeypatch.setattr(ck.dcp, "save", bad_save)
    elif where == "state":
        real_json = ck._write_json

        def bad_json(path, obj):
            if path.endswith("trainer_state.json") and ".step_8.tmp" in path:
                raise Boom()
            return real_json(path, obj)

        monkeypatch.setattr(ck, "_write_json", bad_json)
    elif where == "rename":
        real_rename = os.rename

        def bad_rename(a, b):
            if str(b).endswith("step_8"):
                raise Boom()
            return real_rename(a, b)

        monkeypatch.setattr(ck.os, "rename", bad_rename)
    else:  # crash after step_8 is in place, before `latest` is replaced
        real_replace = os.replace

        def bad_replace(a, b):
            if str(b).endswith("latest") and calls["n"] == 1:
                raise Boom()
            if str(b).endswith("latest"):
                calls["n"] += 1
            return real_replace(a, b)

        monkeypatch.setattr(ck.os, "replace", bad_replace)
    with pytest.raises(Boom):
        tr.fit()
    monkeypatch.undo()
    assert open(run / "latest").read().strip() == "step_4"
    assert (run / "step_4" / "trainer_state.json").exists()

    again = build_trainer(str(run), max_steps=8, ckpt_every=4, val=False)
    assert not list(run.glob(".step_*.tmp"))  # stale temp folder cleaned at start
    again.resume(again.checkpointer.resolve_resume("auto"))
    assert again.sched.step == 4
    again.fit()
    assert [r["loss"] for r in again.history] == [r["loss"] for r in ref.history[4:]]
    assert open(run / "latest").read().strip() == "step_8"


def test_no_weight_decay_groups():
    model = tiny_model(0)
    names = {n: is_no_decay(n, p) for n, p in model.named_parameters()}
    assert names["layers.0.mixer.weight"] is False
    assert names["layers.0.mixer.bias"] and names["layers.0.A_log"]
    assert names["layers.0.norm.weight"] and names["norm_f.weight"]
    assert names["lm_head.weight"] is False and names["embeddings.weight"] is False
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for n, p in model.named_parameters():
        assert wd[id(p)] == (0.0 if names[n] else 0.1), n
