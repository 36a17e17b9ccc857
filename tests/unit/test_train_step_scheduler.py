import pytest

from hybridtrain.training.step_scheduler import (
    EvalBatchSampler,
    MicroBatchSampler,
    StepScheduler,
)


def test_grad_acc_and_divisibility_error():
    s = StepScheduler(global_batch_size=32, micro_batch_size=2, dp_size=4, max_steps=3)
    assert s.grad_acc_steps == 4
    with pytest.raises(ValueError) as e:
        StepScheduler(global_batch_size=30, micro_batch_size=2, dp_size=4, max_steps=3)
    msg = str(e.value)
    assert "training.global_batch_size=30" in msg and "step_scheduler" not in msg
    assert "training.micro_batch_size x the data-parallel size = 2 x 4 = 8" in msg


def test_epochs_and_events():
    s = StepScheduler(8, 2, num_epochs=3, num_train_samples=20, val_every_steps=2,
                      ckpt_every_steps=4, log_every_steps=1)
    assert s.steps_per_epoch == 2 and s.max_steps == 6
    events = []
    while not s.done:
        s.advance()
        events.append((s.step, s.is_val_step, s.is_ckpt_step, s.epoch))
    assert events == [(1, False, False, 0), (2, True, False, 1), (3, False, False, 1),
                      (4, True, True, 2), (5, False, False, 2), (6, True, True, 3)]
    assert s.consumed_samples == 48
    # no interval: validate and checkpoint after the last step only
    s = StepScheduler(8, 2, max_steps=3)
    flags = []
    while not s.done:
        s.advance()
        flags.append((s.is_val_step, s.is_ckpt_step))
    assert flags == [(False, False), (False, False), (True, True)]
    # max_steps wins over num_epochs; fractional epochs
    assert StepScheduler(8, 2, max_steps=10, num_epochs=1, num_train_samples=20).max_steps == 10
    assert StepScheduler(4, 2, num_epochs=0.5, num_train_samples=40).max_steps == 5
    with pytest.raises(ValueError, match="fewer than"):
        StepScheduler(64, 2, max_steps=1, num_train_samples=20)


def test_every_step_sees_the_same_samples_for_any_dp_size():
    n, gbs = 50, 8
    per_step = {}
    for dp in (1, 2, 4):
        mbs = 2
        ga = gbs // (mbs * dp)
        steps = []
        for epoch in range(2):
            ranks = [list(MicroBatchSampler(n, mbs, ga, r, dp, epoch=epoch, seed=3))
                     for r in range(dp)]
            for st in range(len(ranks[0]) // ga):
                steps.append(sorted(i for r in ranks for mb in r[st * ga:(st + 1) * ga]
                                    for i in mb))
        per_step[dp] = steps
    assert per_step[1] == per_step[2] == per_step[4]
    assert len(per_step[1]) == 2 * (n // gbs)
    assert per_step[1][0] != per_step[1][n // gbs]  # epochs are reshuffled


def test_resume_position_and_drop_last_false():
    full = list(MicroBatchSampler(20, 2, 2, epoch=1, seed=0))
    assert list(MicroBatchSampler(20, 2, 2, epoch=1, start_step=2, seed=0)) == full[4:]
    wrap = list(MicroBatchSampler(10, 2, 2, seed=0, shuffle=False, drop_last=False))
    assert wrap == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [0, 1]]


def test_state_dict_roundtrip_and_mismatch():
    s = StepScheduler(8, 2, max_steps=10, num_train_samples=40, seed=1)
    for _ in range(7):
        s.advance(skipped=s.step == 3)
    t = StepScheduler(8, 2, max_steps=10, num_train_samples=40, seed=1)
    t.load_state_dict(s.state_dict())
    assert (t.step, t.epoch, t.step_in_epoch, t.consumed_samples, t.skipped_steps) == \
        (7, 1, 2, 56, 1)
    u = StepScheduler(16, 2, max_steps=10, num_train_samples=40, seed=1)
    with pytest.raises(ValueError, match="global_batch_size=8"):
        u.load_state_dict(s.state_dict())


def test_eval_sampler_even_split():
    ranks = [EvalBatchSampler(7, 2, r, 2) for r in range(2)]
    assert [len(r) for r in ranks] == [2, 2]
    assert list(ranks[0]) == [[0, 1], [4, 5]] and list(ranks[1]) == [[2, 3], [6, 0]]
    assert ranks[1].num_real == [2, 1] and ranks[0].num_real == [2, 2]


def test_too_few_samples_names_the_recipe_key():
    with pytest.raises(ValueError, match="fewer than training.global_batch_size=64; lower"):
        StepScheduler(64, 2, max_steps=1, num_train_samples=20)
