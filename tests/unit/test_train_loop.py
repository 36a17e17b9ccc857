"""Training-loop exactness: gradient accumulation, non-finite skipping, bitwise resume."""

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

from hybridtrain.training.optim import build_optimizer, is_no_decay
from hybridtrain.training.trainer import TrainStep
from tests.helpers.data import collate, sft_dataset
from tests.helpers.models import standin_model, tiny_model
from tests.helpers.training import build_trainer, train_model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grad_accumulation_matches_one_big_batch():
    """4 micro-batches of 2 == 1 batch of 8 (uneven label counts per micro-batch), fp32."""
    ds = sft_dataset(8, seed=5)
    items = [ds[i] for i in range(8)]
    counts = [int((it["labels"] != -100).sum()) for it in items]
    assert len({sum(counts[i:i + 2]) for i in range(0, 8, 2)}) > 1  # really uneven
    step = TrainStep()
    results = []
    for mbs in (2, 8):
        model = train_model(tiny_model, 0, loss_chunk_size=7)
        micro = [collate(ds, items[i:i + mbs]) for i in range(0, 8, mbs)]
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
        tr = build_trainer(None, max_steps=2, mbs=mbs, val=False)
        tr.fit()
        runs.append(([r["loss"] for r in tr.history], tr.model.state_dict()))
    (la, wa), (lb, wb) = runs
    assert la == pytest.approx(lb, rel=1e-6, abs=0)
    # Gradients agree within 1e-6 (test above); Adam divides by sqrt(v), which turns the
    # fp32 summation-order noise of tiny gradients into up to ~lr-sized relative noise, so the
    # weights after two steps are compared at 5e-6.
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=5e-6)


def test_loss_is_token_weighted_mean():
    model = train_model(tiny_model, 0, loss_chunk_size=None)
    ds = sft_dataset(4, seed=2)
    batch = collate(ds, [ds[i] for i in range(4)])
    with torch.no_grad():
        ce = TrainStep.loss_sum(model, batch)
        logits = model(batch["input_ids"])
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                batch["labels"].reshape(-1), reduction="sum")
    torch.testing.assert_close(ce, ref, rtol=1e-6, atol=1e-5)


class NaNAt(TrainStep):
    """Returns a NaN loss on the micro-batches of one step."""

    def __init__(self, bad_step, **kw):
        super().__init__(**kw)
        self.bad_step, self.calls = bad_step, 0

    def loss_sum(self, model, batch):
        ce = super().loss_sum(model, batch)
        return ce * float("nan") if self.calls == self.bad_step else ce

    def __call__(self, model, micro_batches, n):
        self.calls += 1
        return super().__call__(model, micro_batches, n)


def test_nan_step_is_skipped_and_lr_does_not_advance(tmp_path):
    tr = build_trainer(str(tmp_path), max_steps=6, train_step=NaNAt(4), ckpt_every=None)
    summary = tr.fit()
    hist = tr.history
    assert summary["steps"] == 6 and summary["skipped_steps"] == 1
    assert math.isnan(hist[3]["loss"]) and hist[3]["skipped_steps"] == 1
    assert hist[2]["skipped_steps"] == 0 and hist[5]["skipped_steps"] == 1
    # the skipped step's LR is used again by the next step: the schedule did not advance
    f = tr.lr_scheduler.lr_at
    assert [r["lr"] for r in hist] == [f(0), f(1), f(2), f(3), f(3), f(4)]
    assert f(2) != f(3) != f(4)
    assert tr.lr_scheduler.num_steps == 5
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(hist) if i != 3)
    recs = [json.loads(line) for line in open(tmp_path / "training.jsonl")]
    assert recs[3]["loss"] is None and recs[3]["skipped_steps"] == 1  # NaN written as null
    assert [r["consumed_samples"] for r in recs] == [8 * i for i in range(1, 7)]


def test_zero_label_batch_is_skipped():
    tr = build_trainer(None, max_steps=2, val=False)
    mb = collate(tr.data.train, [tr.data.train[i] for i in range(2)])
    mb["labels"][:] = -100
    rec = tr.train_one_step([mb] * 4)
    assert rec["num_label_tokens"] == 0 and rec["skipped_steps"] == 1
    assert tr.lr_scheduler.num_steps == 0


class CrashAt(TrainStep):
    def __init__(self, crash_step):
        super().__init__()
        self.crash_step, self.calls = crash_step, 0

    def __call__(self, model, micro_batches, n):
        self.calls += 1
        if self.calls == self.crash_step:
            raise KeyboardInterrupt("killed")
        return super().__call__(model, micro_batches, n)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


STEPS, EVERY = 6, 3  # checkpoints at steps 3 and 6


def _reference(out_dir, model_fn):
    ref = build_trainer(out_dir, max_steps=STEPS, ckpt_every=EVERY, model_fn=model_fn)
    ref.fit()
    return ([r["loss"] for r in ref.history], _weights(ref.model),
            ref.optimizer.state_dict()["state"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of the tiny Nemotron-H: per-step losses, weights, optimizer state."""
    return _reference(str(tmp_path_factory.mktemp("ref")), tiny_model)


@pytest.fixture(scope="module")
def reference_standin(tmp_path_factory):
    """The same with the small stand-in model (for the checkpoint-crash tests)."""
    return _reference(str(tmp_path_factory.mktemp("ref_standin")), standin_model)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """``crashed(ac, dest)``: a copy at ``dest`` of a run killed in step 5 after its step-3
    checkpoint (blocks plain, or checkpoint-wrapped every second one with ``ac``); returns the
    killed run's first three losses. Each killed run is made once for the module."""
    runs = {}

    def copy_of(ac, dest):
        if ac not in runs:
            run = tmp_path_factory.mktemp("crashed") / "run"
            first = build_trainer(str(run), max_steps=STEPS, ckpt_every=EVERY, train_step=CrashAt(5),
                                  model_fn=_ac_model if ac else tiny_model)
            with pytest.raises(KeyboardInterrupt):
                first.fit()
            runs[ac] = (run, [r["loss"] for r in first.history[:3]])
        shutil.copytree(runs[ac][0], dest)
        return runs[ac][1]

    return copy_of


def test_resume_is_bitwise(tmp_path, reference, crashed):
    ref_losses, ref_weights, ref_opt = reference
    run = tmp_path / "run"
    first_losses = crashed(False, run)
    assert open(run / "latest").read().strip() == "step_3"
    second = build_trainer(str(run), max_steps=STEPS, ckpt_every=EVERY)
    second.resume(second.checkpointer.resolve_resume("auto"))
    assert second.sched.step == 3 and second.lr_scheduler.num_steps == 3
    second.fit()
    losses = first_losses + [r["loss"] for r in second.history]
    assert losses == ref_losses  # bitwise
    w = _weights(second.model)
    assert all(torch.equal(ref_weights[k], w[k]) for k in w)
    opt = second.optimizer.state_dict()["state"]
    assert all(torch.equal(ref_opt[i][k], opt[i][k]) for i in ref_opt for k in ref_opt[i])
    # the jsonl files read as one uninterrupted run (the dead step 4's record was dropped)
    recs = [json.loads(line) for line in open(run / "training.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in recs] == ref_losses
    vals = [json.loads(line)["step"] for line in open(run / "validation.jsonl")]
    assert vals == [0, 4, 6]  # before training, val_every_steps=4, and at the end


def _ac_model(seed):
    from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing

    model = tiny_model(seed)
    apply_activation_checkpointing(model.backbone.layers, {"every": 2})
    return model


@pytest.mark.parametrize("ac", [(True, True), (True, False), (False, True)],
                         ids=["ac->ac", "ac->plain", "plain->ac"])
def test_resume_with_activation_checkpointing_is_bitwise(tmp_path, reference, crashed, ac):
    """Checkpoint-wrapped blocks train, save and resume like plain ones (either way round)."""
    ref_losses, ref_weights, _ = reference
    run = tmp_path / "run"
    first_losses = crashed(ac[0], run)
    second = build_trainer(str(run), max_steps=STEPS, ckpt_every=EVERY, model_fn=_ac_model if ac[1] else tiny_model)
    second.resume(second.checkpointer.resolve_resume("auto"))
    second.fit()
    losses = first_losses + [r["loss"] for r in second.history]
    assert losses == ref_losses  # bitwise
    w = _weights(second.model)
    assert w.keys() == ref_weights.keys()
    assert all(torch.equal(ref_weights[k], w[k]) for k in w)


@pytest.mark.parametrize("where", ["dcp", "state", "rename", "latest"])
def test_crash_while_checkpointing_keeps_previous(tmp_path, monkeypatch, where,
                                                  reference_standin):
    import hybridtrain.training.checkpoint as ck

    ref_losses = reference_standin[0]
    run = tmp_path / "run"
    tr = build_trainer(str(run), max_steps=STEPS, ckpt_every=EVERY, model_fn=standin_model)
    last = f"step_{STEPS}"

    class Boom(RuntimeError):
        pass

    calls = {"n": 0}
    if where == "dcp":
        real = ck.dcp.save  # called through dcp_save

        def bad_save(sd, **kw):
            calls["n"] += 1
            if calls["n"] == 2:  # the last checkpoint: write half of it, then die
                real({k: v for i, (k, v) in enumerate(sd.items()) if i % 2}, **kw)
                raise Boom()
            return real(sd, **kw)

        monkeypatch.setattr(ck.dcp, "save", bad_save)
    elif where == "state":
        real_json = ck.write_step_json

        def bad_json(path, obj):
            if path.endswith("trainer_state.json") and f".{last}.tmp" in path:
                raise Boom()
            return real_json(path, obj)

        monkeypatch.setattr(ck, "write_step_json", bad_json)
    elif where == "rename":
        real_rename = os.rename

        def bad_rename(a, b):
            if str(b).endswith(last):
                raise Boom()
            return real_rename(a, b)

        monkeypatch.setattr(ck.os, "rename", bad_rename)
    else:  # crash after the folder is in place, before `latest` is replaced
        real_replace = os.replace

        def bad_replace(a, b):
            if str(b).endswith("latest"):
                calls["n"] += 1
                if calls["n"] == 2:
                    raise Boom()
            return real_replace(a, b)

        monkeypatch.setattr(ck.os, "replace", bad_replace)
    with pytest.raises(Boom):
        tr.fit()
    monkeypatch.undo()
    assert open(run / "latest").read().strip() == f"step_{EVERY}"
    assert (run / f"step_{EVERY}" / "trainer_state.json").exists()

    from hybridtrain.runfolder import RunLock

    with RunLock(run):  # the next run takes the folder: a stale temp folder is removed
        assert not list(run.glob(".step_*.tmp"))
    again = build_trainer(str(run), max_steps=STEPS, ckpt_every=EVERY, model_fn=standin_model)
    again.resume(again.checkpointer.resolve_resume("auto"))
    assert again.sched.step == EVERY
    again.fit()
    assert [r["loss"] for r in again.history] == ref_losses[EVERY:]
    assert open(run / "latest").read().strip() == last


def test_no_weight_decay_groups():
    model = tiny_model(0)
    names = {n: is_no_decay(n, p) for n, p in model.named_parameters()}
    m = "backbone.layers.0.mixer."
    assert all(names[m + k] for k in ("A_log", "D", "dt_bias", "conv1d.bias", "norm.weight"))
    assert not names[m + "in_proj.weight"] and not names[m + "conv1d.weight"]
    assert names["backbone.layers.0.norm.weight"] and names["backbone.norm_f.weight"]
    assert not names["lm_head.weight"] and not names["backbone.embeddings.weight"]
    assert not names["backbone.layers.3.mixer.experts.up_proj"]
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for n, p in model.named_parameters():
        assert wd[id(p)] == (0.0 if names[n] else 0.1), n


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "below_the_limit"])
def test_trainer_clips_then_steps(max_norm):
    """A trainer step is forward/backward, clip_grad_norm(params, grad_clip), optimizer.step()."""
    from hybridtrain.distributed.utils import clip_grad_norm_

    tr = build_trainer(None, max_steps=2, val=False)
    tr.settings = dataclasses.replace(tr.settings, training=tr.settings.training.replace(
        grad_clip=max_norm))
    model = train_model(tiny_model, 0)
    opt = build_optimizer(model, lr=tr.optimizer.param_groups[0]["lr"], weight_decay=0.1)
    micro = [collate(tr.data.train, [tr.data.train[i] for i in range(k, k + 2)])
             for k in range(0, 8, 2)]
    rec = tr.train_one_step(micro)
    n = sum(int((m["labels"] != -100).sum()) for m in micro)
    TrainStep()(model, micro, n)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = clip_grad_norm_(params, max_norm)
    opt.step()
    assert rec["grad_norm"] == float(norm) and (float(norm) > max_norm) == (max_norm < 1)
    for (name, a), b in zip(tr.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_trainer_settings_come_from_the_recipe_sections_over_their_defaults():
    from hybridtrain.config import ConfigError
    from hybridtrain.config.recipe import CheckpointSection, TrainingSection
    from hybridtrain.training.settings import trainer_settings

    s = trainer_settings({"grad_clip": None, "gc_every_steps": 3}, {"enabled": False})
    assert (s.training.grad_clip, s.training.gc_every_steps, s.checkpoint.enabled) == \
        (None, 3, False)
    assert s.training.max_consecutive_skipped_steps == \
        TrainingSection().max_consecutive_skipped_steps
    assert s.checkpoint.save_hf_at_end == CheckpointSection().save_hf_at_end
    with pytest.raises(ConfigError, match="training.grad_clipp"):
        trainer_settings({"grad_clipp": 1.0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.training = None
