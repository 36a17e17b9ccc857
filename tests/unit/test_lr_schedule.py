import math

import pytest
import torch

from hybridtrain.training.lr_schedule import LRScheduler, lr_at


def _opt(lr=1.0):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(sched: LRScheduler, n: int, samples: int = 0) -> list[float]:
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.step(samples)
    return out


def test_warmup_then_constant():
    lrs = _lrs(LRScheduler(_opt(), lr_decay_style="constant", lr_warmup_steps=4), 8)
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_init_lr_warmup():
    s = LRScheduler(_opt(), lr_decay_style="constant", lr_warmup_steps=2, init_lr=0.5)
    assert _lrs(s, 3) == pytest.approx([0.75, 1.0, 1.0])


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_key_points(style):
    s = LRScheduler(_opt(2.0), lr_decay_style=style, lr_warmup_steps=10, min_lr=0.2,
                    total_steps=110)
    assert s.lr_at(0) == pytest.approx(0.2)  # 2.0 * 1/10
    assert s.lr_at(9) == pytest.approx(2.0)  # end of warmup
    assert s.lr_at(10) == pytest.approx(2.0)  # decay starts at the peak
    assert s.lr_at(60) == pytest.approx(1.1)  # midpoint: (peak + min) / 2 for both shapes
    assert s.lr_at(110) == pytest.approx(0.2)
    assert s.lr_at(500) == pytest.approx(0.2)  # min_lr after the end
    quarter = s.lr_at(35)
    expect = 0.2 + 1.8 * (0.75 if style == "linear" else 0.5 * (1 + math.cos(math.pi / 4)))
    assert quarter == pytest.approx(expect)


@pytest.mark.parametrize("decay", ["linear", "cosine", "minus_sqrt"])
def test_wsd(decay):
    s = LRScheduler(_opt(1.0), lr_decay_style="wsd", lr_warmup_steps=10, lr_decay_steps=100,
                    lr_wsd_decay_steps=20, lr_wsd_decay_style=decay, min_lr=0.0)
    assert s.lr_at(4) == pytest.approx(0.5)
    assert s.lr_at(10) == s.lr_at(50) == s.lr_at(80) == pytest.approx(1.0)  # stable
    mid = {"linear": 0.5, "cosine": 0.5, "minus_sqrt": 1 - math.sqrt(0.5)}[decay]
    assert s.lr_at(90) == pytest.approx(mid)
    q = {"linear": 0.75, "cosine": 0.5 * (1 + math.cos(math.pi / 4)), "minus_sqrt": 0.5}[decay]
    assert s.lr_at(85) == pytest.approx(q)
    assert s.lr_at(100) == pytest.approx(0.0)


def test_wsd_default_decay_is_ten_percent():
    s = LRScheduler(_opt(1.0), lr_decay_style="wsd", total_steps=200)
    assert s.wsd_decay_length == 20
    assert s.lr_at(180) == 1.0 and s.lr_at(190) == pytest.approx(0.5)


def test_sample_based_lengths():
    s = LRScheduler(_opt(1.0), lr_decay_style="linear", lr_warmup_samples=32,
                    lr_decay_samples=160)
    assert s.units == "samples"
    lrs = _lrs(s, 6, samples=16)  # positions 0, 16, 32, ... samples
    assert lrs == pytest.approx([1 / 32, 17 / 32, 1.0, 0.875, 0.75, 0.625])


def test_state_dict_roundtrip_and_skip_semantics():
    s = LRScheduler(_opt(1.0), lr_decay_style="cosine", lr_warmup_steps=3, total_steps=20)
    _lrs(s, 7)
    state = s.state_dict()
    t = LRScheduler(_opt(1.0), lr_decay_style="cosine", lr_warmup_steps=3, total_steps=20)
    t.load_state_dict(state)
    assert t.optimizer.param_groups[0]["lr"] == s.optimizer.param_groups[0]["lr"] == s.lr_at(7)


def test_lr_mult_and_errors():
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr_mult": 0.5},
                             {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=1.0)
    LRScheduler(opt)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1.0]
    with pytest.raises(ValueError, match="lr_decay_style"):
        LRScheduler(_opt(), lr_decay_style="exp")
    with pytest.raises(ValueError, match="needs lr_decay_steps"):
        LRScheduler(_opt(), lr_decay_style="cosine")
    with pytest.raises(ValueError, match="mixed"):
        LRScheduler(_opt(), lr_decay_style="linear", lr_decay_steps=10, lr_warmup_samples=4)
    with pytest.raises(ValueError, match="longer than the decay"):
        LRScheduler(_opt(), lr_decay_style="linear", lr_warmup_steps=20, lr_decay_steps=10)
    # a rank with nothing to train has no optimizer: the schedule follows the run at an lr
    with pytest.raises(ValueError, match=r"no optimizer .* set lr_scheduler\.lr"):
        LRScheduler(None)
    assert LRScheduler(None, lr=0.5).get_lr() == 0.5
    # a run shorter than the warmup (e.g. --training.max_steps=5): warm up over the whole run
    s = LRScheduler(_opt(), lr_decay_style="cosine", lr_warmup_steps=20, total_steps=5)
    assert s.warmup == 5 and s.lr_at(4) == 1.0


def test_lr_at_is_pure():
    assert lr_at(0, lr=1.0, style="constant") == 1.0
    assert lr_at(5, lr=1.0, style="linear", warmup=0, decay_steps=10) == pytest.approx(0.5)
