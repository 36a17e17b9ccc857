"""The RL Policy in one process: log-probs against transformers' log-softmax on the same weights,
packed against unpacked rows, micro-batching, top-k logits, Hub-named weights, checkpoints."""

from __future__ import annotations

import os

import pytest
import torch

from hybridtrain.rl import ClippedPGLoss, DPOLoss, NLLLoss, Policy
from tests.helpers.recipes import tiny_recipe

B, S = 6, 12
LENGTHS = [12, 5, 9, 2, 12, 7]


def policy_recipe(**sections):
    r = tiny_recipe(**sections)
    r.pop("dataset")
    return r


def rl_batch(seed: int = 0, vocab: int = 200) -> dict:
    """Rows of uneven length with every key of the RL batch (prompt tokens masked out)."""
    g = torch.Generator().manual_seed(seed)
    tm = torch.ones(B, S)
    tm[:, :3] = 0
    return {
        "input_ids": torch.randint(1, vocab, (B, S), generator=g),
        "input_lengths": torch.tensor(LENGTHS),
        "token_mask": tm,
        "sample_mask": torch.tensor([1.0, 1, 1, 0, 1, 1]),
        "advantages": torch.randn(B, S, generator=g),
        "prev_logprobs": -torch.rand(B, S, generator=g) * 6,
        "generation_logprobs": -torch.rand(B, S, generator=g) * 6,
        "reference_policy_logprobs": -torch.rand(B, S, generator=g) * 6,
    }


@pytest.fixture(scope="module")
def policy():
    return Policy(policy_recipe())


def _valid(lengths=LENGTHS):
    return torch.arange(S - 1)[None] < (torch.tensor(lengths) - 1)[:, None]


def test_logprobs_match_transformers(policy, tmp_path):
    from tests.helpers.hf import hf_from_dir, hf_logits

    batch = rl_batch()
    lp = policy.logprobs(batch)
    assert lp.shape == (B, S - 1) and lp.dtype == torch.float32
    policy.model.save_pretrained(tmp_path / "hf")
    ids = batch["input_ids"]
    ref = hf_logits(hf_from_dir(tmp_path / "hf"), ids).float().log_softmax(-1)
    ref = ref[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = _valid()
    assert float((lp - ref)[valid].abs().max()) <= 1e-4
    assert float(lp[~valid].abs().max()) == 0.0  # 0 from each row's length - 1 on


def test_state_dict_hf_is_the_hub_checkpoint(policy, tmp_path):
    from safetensors.torch import load_file

    policy.model.save_pretrained(tmp_path / "hf")
    hub = load_file(os.path.join(tmp_path / "hf", "model.safetensors"))
    streamed = dict(policy.state_dict_hf())
    assert set(streamed) == set(hub)
    assert all(torch.equal(streamed[k], hub[k]) for k in hub)
    assert {t.dtype for _, t in policy.state_dict_hf(torch.bfloat16)} == {torch.bfloat16}


def test_packed_equals_unpacked(policy):
    batch = rl_batch(1)
    unpacked = policy.logprobs(batch)
    policy.packing = True
    try:
        packed = policy.logprobs(batch)
    finally:
        policy.packing = False
    assert float((packed - unpacked).abs().max()) <= 1e-5


def test_topk_logits_are_the_largest_logits(policy):
    batch = rl_batch(2)
    values, ids = policy.topk_logits(batch, 4)
    assert values.shape == ids.shape == (B, S, 4) and ids.dtype == torch.long
    with torch.no_grad():
        want = policy.model(batch["input_ids"]).float().topk(4, dim=-1)
    keep = torch.arange(S)[None] < torch.tensor(LENGTHS)[:, None]
    assert float((values - want.values)[keep].abs().max()) <= 1e-5
    assert torch.equal(ids[keep], want.indices[keep])
    assert float(values[~keep].abs().max()) == 0.0


def _weights(p):
    return {k: v.detach().clone() for k, v in p.model.state_dict().items()}


@pytest.mark.parametrize("loss_fn", [NLLLoss(), ClippedPGLoss(reference_policy_kl_penalty=0.1),
                                     DPOLoss(sft_loss_weight=0.5)], ids=["nll", "pg", "dpo"])
def test_train_step_is_the_same_for_any_micro_batching_and_packing(loss_fn):
    """One step over the whole batch at once == micro-batches of 2 rows == packed micro-batches."""
    results = []
    for mbs, packed in ((6, False), (2, False), (2, True)):
        p = Policy(policy_recipe(rl={"sequence_packing": packed}))
        rec = p.train(rl_batch(3), loss_fn, micro_batch_size=mbs)
        results.append((rec, _weights(p)))
    (ref, w_ref), *others = results
    assert not ref["skipped"] and ref["num_valid_seqs"] == 5
    for rec, w in others:
        assert rec["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert max(float((w[k] - w_ref[k]).abs().max()) for k in w) <= 1e-5  # lr 2e-4


def test_train_loss_is_the_loss_of_the_logprobs(policy):
    """The step's reported loss is the loss function on ``logprobs`` of the weights before it."""
    batch = rl_batch(4)
    lp = policy.logprobs(batch)
    from hybridtrain.rl.batch import global_counts, prepare

    full = prepare(batch)
    want, _ = NLLLoss()(lp, full, *global_counts(full))
    rec = policy.train(batch, NLLLoss())
    assert rec["loss"] == pytest.approx(float(want), rel=1e-5)
    assert rec["lr"] > 0 and rec["grad_norm"] > 0


def test_checkpoint_round_trip(tmp_path):
    batch = rl_batch(5)
    a = Policy(policy_recipe())
    a.train(batch, NLLLoss())
    a.save_checkpoint(str(tmp_path / "run"))
    after = a.train(batch, NLLLoss())
    b = Policy(policy_recipe(training={"seed": 7}))  # other initial weights
    b.load_checkpoint(str(tmp_path / "run"))
    assert b.step == 1
    again = b.train(batch, NLLLoss())
    assert again["loss"] == pytest.approx(after["loss"], rel=1e-6)
    assert max(float((_weights(a)[k] - _weights(b)[k]).abs().max()) for k in _weights(a)) <= 1e-6


def test_batch_mistakes_name_the_key(policy):
    batch = rl_batch()
    with pytest.raises(ValueError, match="input_lengths"):
        policy.logprobs({**batch, "input_lengths": torch.tensor([0] * B)})
    with pytest.raises(ValueError, match="advantages"):
        policy.logprobs({**batch, "advantages": torch.zeros(B, S + 1)})
    with pytest.raises(ValueError, match="micro_batch_size"):
        policy.train(batch, DPOLoss(), micro_batch_size=3)


def test_lora_policy_trains_adapters_and_streams_merged_weights():
    """With a peft section only the adapters train; the streamed weights are the merged model,
    whose plain copy gives the Policy's log-probs."""
    p = Policy(policy_recipe(peft={"dim": 4, "alpha": 8, "match_all_linear": True}))
    batch = rl_batch(6)
    frozen = {n: t.detach().clone() for n, t in p.model.named_parameters() if not t.requires_grad}
    p.train(batch, NLLLoss())
    p.train(batch, NLLLoss())  # LoRA B starts at zero: the second step moves the output
    assert all(torch.equal(t, dict(p.model.named_parameters())[n]) for n, t in frozen.items())
    full = p.state_dict_full()
    assert not any("lora" in k for k in full) and not any("lora" in k for k, _ in p.state_dict_hf())
    from hybridtrain.config import instantiate

    plain = instantiate(p.cfg.model)
    plain.load_state_dict(full)
    with torch.no_grad():
        logits = plain(batch["input_ids"]).float().log_softmax(-1)
    ref = logits[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    lp = p.logprobs(batch)
    assert float((lp - ref)[_valid()].abs().max()) <= 1e-5
    base = Policy(policy_recipe())  # the same base weights, no adapters
    assert float((lp - base.logprobs(batch)).abs().max()) > 1e-4


def test_consecutive_skipped_updates_stop_the_policy_loop():
    from hybridtrain.training.trainer import TrainingDiverged

    p = Policy(policy_recipe(training={"max_consecutive_skipped_steps": 2}))
    nan_adv = {**rl_batch(), "advantages": torch.full((B, S), float("nan"))}
    loss = ClippedPGLoss()
    assert p.train(nan_adv, loss)["skipped"]
    assert not p.train(rl_batch(), loss)["skipped"]  # a good update ends the streak
    assert p.train(nan_adv, loss)["skipped"]
    with pytest.raises(TrainingDiverged, match="2 consecutive updates"):
        p.train(nan_adv, loss)
    assert p.step == 1


MTP_MODEL = {"config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed",
                        "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}}


def _mtp_weights(p) -> dict:
    return {k: v for k, v in _weights(p).items() if k.startswith("mtp.")}


def test_the_mtp_layers_train_beside_the_policy():
    """``training.mtp: train``: the MTP layers learn the scored sequences' tokens ahead as in
    finetuning (``mtp_loss`` normalised over the whole batch: any micro-batching and packing
    give the same update) and the RL loss is unchanged; ``freeze`` leaves them as loaded."""
    results = []
    for mtp, mbs, packed in (("train", 6, False), ("train", 2, True), ("freeze", 6, False)):
        p = Policy(policy_recipe(model=MTP_MODEL, training={"mtp": mtp}, rl={"sequence_packing": packed}))
        before = _mtp_weights(p)
        rec = p.train(rl_batch(3), NLLLoss(), micro_batch_size=mbs)
        results.append((rec, before, _weights(p)))
    (ref, before, w_ref), (other, _, w), (frozen, frozen_before, w_frozen) = results
    assert 0 < ref["mtp_loss"] < 20 and other["mtp_loss"] == pytest.approx(ref["mtp_loss"], rel=1e-5)
    assert max(float((w[k] - w_ref[k]).abs().max()) for k in w) <= 1e-5
    assert all(not torch.equal(w_ref[k], before[k]) for k in before if k.endswith("eh_proj.weight"))
    assert frozen["loss"] == pytest.approx(ref["loss"], rel=1e-6) and "mtp_loss" not in frozen
    assert all(torch.equal(w_frozen[k], frozen_before[k]) for k in frozen_before)
