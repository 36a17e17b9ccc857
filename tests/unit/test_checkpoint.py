"""Checkpointer: layout, retention, resume resolution, config checks, RNG, convert."""

import json
import os
import random

import pytest
import torch
from tests.helpers.models import standin_model, tiny_model

from hybridtrain.training.checkpoint import Checkpointer
from hybridtrain.training.checkpoint_reader import convert
from hybridtrain.training.lr_schedule import LRScheduler
from hybridtrain.training.optim import build_optimizer
from hybridtrain.training.step_scheduler import StepScheduler


def _state(model_fn=standin_model, seed=0):
    model = model_fn(seed)
    opt = build_optimizer(model, lr=1e-2)
    # one real update so the optimizer has state
    model(torch.tensor([[1, 2, 3]])).float().sum().backward()
    opt.step()
    opt.zero_grad()
    lrs = LRScheduler(opt, lr_decay_style="linear", total_steps=10)
    lrs.step(4)
    sched = StepScheduler(4, 2, max_steps=10, num_train_samples=40)
    sched.advance()
    return model, opt, lrs, sched


def test_layout_and_roundtrip(tmp_path):
    model, opt, lrs, sched = _state()
    ck = Checkpointer(str(tmp_path))
    torch.manual_seed(7)
    random.seed(7)
    path = ck.save(1, model, opt, lrs, sched)
    expect_torch, expect_py = torch.rand(3), random.random()
    assert os.path.basename(path) == "step_1"
    assert open(tmp_path / "latest").read() == "step_1\n"
    names = set(os.listdir(path))
    assert {"dcp", "trainer_state.json", "rng", "config.json"} <= names
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))
    state = json.load(open(os.path.join(path, "trainer_state.json")))
    assert state["step_scheduler"]["step"] == 1 and state["lr_scheduler"]["num_steps"] == 1

    model2, opt2, lrs2, sched2 = _state(seed=1)  # different weights and counters
    lrs2.step(4)
    sched2.advance()
    ck.load(ck.resolve_resume("auto"), model2, opt2, lrs2, sched2)
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert all(torch.equal(s1["state"][i][k], s2["state"][i][k])
               for i in s1["state"] for k in s1["state"][i])
    assert lrs2.num_steps == 1 and sched2.step == 1
    assert opt2.param_groups[0]["lr"] == lrs.get_lr()
    assert torch.equal(torch.rand(3), expect_torch) and random.random() == expect_py


def test_resolve_resume(tmp_path):
    model, opt, lrs, sched = _state()
    ck = Checkpointer(str(tmp_path / "run"))
    assert ck.resolve_resume("auto") is None and ck.resolve_resume(None) is None
    ck.save(1, model, opt, lrs, sched)
    ck.save(2, model, opt, lrs, sched)
    step2 = str(tmp_path / "run" / "step_2")
    assert ck.resolve_resume("auto") == step2
    assert ck.resolve_resume(str(tmp_path / "run")) == step2  # a run folder -> its latest
    assert ck.resolve_resume(str(tmp_path / "run" / "step_1")).endswith("step_1")
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        ck.resolve_resume(str(tmp_path / "nowhere"))


def test_keep_last_never_deletes_latest(tmp_path):
    model, opt, lrs, sched = _state()
    ck = Checkpointer(str(tmp_path), keep_last=2)
    for s in (2, 4, 6, 8):
        ck.save(s, model, opt, lrs, sched)
    assert ck.steps() == [6, 8]
    # a run resumed from an older checkpoint saves step 3: it is `latest`, so it stays
    ck.save(3, model, opt, lrs, sched)
    assert open(tmp_path / "latest").read().strip() == "step_3"
    assert 3 in ck.steps() and ck.steps() == [3, 6, 8]
    # a new run in the same folder (resume: null) starts from a clean slate
    assert ck.clear() == ["step_3", "step_6", "step_8", "latest"]
    assert ck.steps() == [] and ck.latest() is None


def test_refuses_a_different_model_config(tmp_path):
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM

    model, opt, lrs, sched = _state(tiny_model)
    ck = Checkpointer(str(tmp_path))
    ck.save(1, model, opt, lrs, sched)
    other = NemotronHForCausalLM(model.config.replace(hidden_size=48))
    with pytest.raises(ValueError, match=r"model config differs[\s\S]*hidden_size: checkpoint 32"):
        ck.load(ck.latest(), other, build_optimizer(other))


def test_convert_gives_the_hf_export(tmp_path):
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM

    model, opt, lrs, sched = _state(tiny_model)
    ck = Checkpointer(str(tmp_path / "run"))
    step = ck.save(1, model, opt, lrs, sched, export=True)
    assert os.path.isfile(os.path.join(step, "hf", "config.json"))
    out = convert(str(tmp_path / "run"), str(tmp_path / "converted"))
    loaded = NemotronHForCausalLM.from_pretrained(out)
    exported = NemotronHForCausalLM.from_pretrained(os.path.join(step, "hf"))
    for (n, a), b, c in zip(model.state_dict().items(), loaded.state_dict().values(),
                            exported.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c), n
    with pytest.raises(ValueError, match="not a checkpoint"):
        convert(str(tmp_path), str(tmp_path / "x"))


def test_lora_checkpoint_holds_adapters_only(tmp_path):
    from hybridtrain.peft.lora import apply_lora

    peft = {"dim": 2, "alpha": 4, "target_modules": ["q_proj", "in_proj"]}
    model = tiny_model(0)
    apply_lora(model, **peft)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p)  # non-trivial adapters
    opt = build_optimizer(model, lr=1e-2)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    ck = Checkpointer(str(tmp_path / "run"), state_extra={"peft": peft})
    step = ck.save(1, model, opt)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(os.path.join(step, "dcp")).read_metadata().state_dict_metadata
    buffers = {n for n, _ in model.named_buffers()}
    assert {k[len("model."):] for k in saved if k.startswith("model.")} - buffers == trainable

    fresh = tiny_model(0)  # same base init, fresh adapters
    apply_lora(fresh, **peft)
    ck.load(step, fresh, build_optimizer(fresh, lr=1e-2))
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    out = convert(str(tmp_path / "run"), str(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))

    # read back whole (generate / evaluate of a step without an export): the recorded base
    # model's weights with the checkpoint's adapters
    from hybridtrain.training.checkpoint_reader import load_checkpoint_model

    tiny_model(0).save_pretrained(str(tmp_path / "base"))
    Checkpointer(str(tmp_path / "run2"), state_extra={
        "peft": peft, "base_model_name_or_path": str(tmp_path / "base")}).save(1, model, opt)
    loaded, _ = load_checkpoint_model(str(tmp_path / "run2"))
    for (n, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), n


def test_refuses_different_peft_settings(tmp_path):
    model, opt, lrs, sched = _state()
    peft = {"method": "lora", "dim": 8, "alpha": 32, "dropout": 0.0, "target_modules": ["*"]}
    path = Checkpointer(str(tmp_path), state_extra={"peft": peft}).save(1, model, opt, lrs, sched)
    # dropout does not shape the adapters: allowed to change
    Checkpointer(str(tmp_path), state_extra={"peft": {**peft, "dropout": 0.1}}).load(path, model)
    with pytest.raises(ValueError, match=r"peft settings differ[\s\S]*peft.dim: checkpoint 8, this run 4"):
        Checkpointer(str(tmp_path), state_extra={"peft": {**peft, "dim": 4}}).load(path, model)
    with pytest.raises(ValueError, match="checkpoint has adapters, this run has no peft section"):
        Checkpointer(str(tmp_path)).load(path, model)


def _with_ac(model):
    from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing

    assert apply_activation_checkpointing(model.backbone.layers, {"every": 2})
    return model


def _dcp_keys(step_dir):
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(os.path.join(step_dir, "dcp")).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_activation_checkpointing_keeps_checkpoint_and_export_keys(tmp_path, lora):
    """Checkpoint-wrapped blocks add ``_checkpoint_wrapped_module`` to named_parameters(): the
    state dict, the DCP checkpoint, the HF export and the LoRA adapter keys must not see it."""
    from safetensors import safe_open

    from hybridtrain.peft.export import adapter_config, peft_state_dict
    from hybridtrain.peft.lora import apply_lora, lora_settings, lora_state_dict, merged_state_dict

    peft = {"dim": 2, "alpha": 4, "target_modules": ["q_proj", "in_proj", "experts.up_proj"]}
    out = {}
    for ac in (False, True):
        model, opt, lrs, sched = _state(tiny_model)
        if lora:
            apply_lora(model, **peft)
            opt = build_optimizer(model, lr=1e-2)
        if ac:
            _with_ac(model)
            assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
        step = Checkpointer(str(tmp_path / f"ac{ac}"), state_extra={"peft": peft} if lora else None
                            ).save(1, model, opt, lrs, sched, export=True)
        keys = {"state_dict": list(model.state_dict()), "dcp": _dcp_keys(step)}
        if lora:
            keys.update(lora=list(lora_state_dict(model)), peft=list(peft_state_dict(model)),
                        config=adapter_config(model), settings=lora_settings(model),
                        merged=list(merged_state_dict(model)))
        with safe_open(os.path.join(step, "hf", "model.safetensors"), "pt") as f:
            keys["hf"] = sorted(f.keys())
        out[ac] = keys
    assert out[True] == out[False]
    assert not any("_checkpoint_wrapped_module" in k for k in out[True]["dcp"])


@pytest.mark.parametrize("final", [False, True])
def test_export_fn_gets_the_final_flag(tmp_path, final):
    """``save(..., final=...)`` hands that flag to ``export_fn`` (LoRA writes merged_hf/ only on
    the final checkpoint), not the step folder's path."""
    seen = []
    model, opt, lrs, sched = _state()
    ck = Checkpointer(str(tmp_path), export_fn=lambda m, d, tok, fin: seen.append(fin))
    path = ck.save(3, model, opt, lrs, sched, export=True, final=final)
    assert seen == [final]
    assert path == os.path.join(str(tmp_path), "step_3")
