"""The RL losses against the reference formulas written out here element by element (Python
floats, fp64), and the share property: micro-batch shares sum to the global loss."""

from __future__ import annotations

import math

import pytest
import torch

from hybridtrain.rl.losses import ClippedPGLoss, DPOLoss, NLLLoss

B, S = 6, 7


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tm = (torch.rand(B, S, generator=g) > 0.3).float()
    tm[:, 0] = 0
    tm[:, 1] = 1  # every row has a trained token
    sm = torch.tensor([1.0, 1, 0, 1, 1, 1])
    logp = -torch.rand(B, S - 1, generator=g, dtype=torch.float64) * 3
    batch = {
        "input_ids": torch.randint(1, 50, (B, S), generator=g),
        "token_mask": tm.double(), "sample_mask": sm.double(),
        "advantages": torch.randn(B, S, generator=g, dtype=torch.float64),
        "prev_logprobs": torch.nn.functional.pad(logp + 0.3 * torch.randn(B, S - 1, generator=g,
                                                 dtype=torch.float64), (1, 0)),
        "generation_logprobs": torch.nn.functional.pad(logp + 0.2 * torch.randn(
            B, S - 1, generator=g, dtype=torch.float64), (1, 0)),
        "reference_policy_logprobs": torch.nn.functional.pad(logp + 0.5 * torch.randn(
            B, S - 1, generator=g, dtype=torch.float64), (1, 0)),
    }
    return logp, batch


def _counts(batch):
    tm, sm = batch["token_mask"].tolist(), batch["sample_mask"].tolist()
    gvs = sum(sm)
    gvt = sum(tm[b][t + 1] * sm[b] for b in range(B) for t in range(S - 1))
    return gvs, gvt


def _reduce(vals, batch, token_level, gvs, gvt):
    """vals[b][t] over the next-token positions."""
    tm, sm = batch["token_mask"].tolist(), batch["sample_mask"].tolist()
    if token_level:
        return sum(vals[b][t] * tm[b][t + 1] * sm[b] for b in range(B) for t in range(S - 1)) / (gvt + 1e-8)
    total = 0.0
    for b in range(B):
        n = sum(tm[b][t + 1] for t in range(S - 1))
        total += sm[b] * sum(vals[b][t] * tm[b][t + 1] for t in range(S - 1)) / (n + 1e-8)
    return total / (gvs + 1e-8)


def _pg_reference(logp, batch, eps_lo, eps_hi, c, beta, kl_type, token_level, is_corr):
    gvs, gvt = _counts(batch)
    lp = logp.tolist()
    A, prev, gen, ref = (batch[k][:, 1:].tolist() for k in
                         ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"))
    actor, kl, clipfrac = [], [], []
    for b in range(B):
        ra, rk, rc = [], [], []
        for t in range(S - 1):
            r = math.exp(lp[b][t] - prev[b][t])
            rcl = min(max(r, 1 - eps_lo), 1 + eps_hi)
            l1, l2 = -A[b][t] * r, -A[b][t] * rcl
            ell = max(l1, l2)
            if c is not None and A[b][t] < 0:
                ell = min(ell, -A[b][t] * c)
            if is_corr:
                ell *= math.exp(prev[b][t] - gen[b][t])
            lr = min(max(ref[b][t] - lp[b][t], -20), 20)
            k = {"k1": -lr, "k2": lr * lr / 2, "k3": math.exp(lr) - 1 - lr}[kl_type]
            ra.append(ell)
            rk.append(min(max(k, -10), 10))
            rc.append(1.0 if l2 > l1 else 0.0)
        actor.append(ra)
        kl.append(rk)
        clipfrac.append(rc)
    a = _reduce(actor, batch, token_level, gvs, gvt)
    k = _reduce(kl, batch, token_level, gvs, gvt)
    return a + beta * k, a, k, _reduce(clipfrac, batch, token_level, gvs, gvt)


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("dual,is_corr", [(None, False), (3.0, True)])
def test_clipped_pg_matches_reference(token_level, kl_type, dual, is_corr):
    logp, batch = _batch()
    gvs, gvt = _counts(batch)
    fn = ClippedPGLoss(ratio_clip_min=0.1, ratio_clip_max=0.3, ratio_clip_c=dual,
                       reference_policy_kl_penalty=0.2, kl_type=kl_type,
                       token_level_loss=token_level, use_importance_sampling_correction=is_corr)
    loss, m = fn(logp, batch, gvs, gvt)
    want, actor, kl, clip = _pg_reference(logp, batch, 0.1, 0.3, dual, 0.2, kl_type, token_level, is_corr)
    assert float(loss) == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert float(m["actor_loss"]) == pytest.approx(actor, rel=1e-10, abs=1e-12)
    assert float(m["kl"]) == pytest.approx(kl, rel=1e-10, abs=1e-12)
    assert float(m["clip_fraction"]) == pytest.approx(clip, rel=1e-10, abs=1e-12)
    assert 0 < float(m["clip_fraction"]) < 1


def test_nll_matches_reference():
    logp, batch = _batch(1)
    gvs, gvt = _counts(batch)
    loss, _ = NLLLoss()(logp, batch, gvs, gvt)
    want = _reduce((-logp).tolist(), batch, True, gvs, gvt)
    assert float(loss) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("sft", [0.0, 0.5])
def test_dpo_matches_reference(average, sft):
    logp, batch = _batch(2)
    gvs, gvt = _counts(batch)
    beta = 0.1
    loss, m = DPOLoss(reference_policy_kl_penalty=beta, sft_loss_weight=sft,
                      preference_average_log_probs=average)(logp, batch, gvs, gvt)
    lp, ref = logp.tolist(), batch["reference_policy_logprobs"][:, 1:].tolist()
    tm, sm = batch["token_mask"].tolist(), batch["sample_mask"].tolist()
    r = []
    for b in range(B):
        mask = [tm[b][t + 1] * sm[b] for t in range(S - 1)]
        v = sum((lp[b][t] - ref[b][t]) * mask[t] for t in range(S - 1))
        r.append(v / (sum(mask) + 1e-8) if average else v)
    pairs = gvs / 2
    pref = sum(-math.log(1 / (1 + math.exp(-beta * (r[2 * i] - r[2 * i + 1])))) * sm[2 * i]
               for i in range(B // 2)) / pairs
    nll = 0.0
    for i in range(B // 2):
        b = 2 * i
        n = sum(tm[b][t + 1] for t in range(S - 1))
        nll += sm[b] * -sum(lp[b][t] * tm[b][t + 1] for t in range(S - 1)) / n
    nll /= pairs
    acc = sum(sm[2 * i] * (r[2 * i] > r[2 * i + 1]) for i in range(B // 2)) / pairs
    assert float(loss) == pytest.approx(pref + sft * nll, rel=1e-7)
    assert float(m["accuracy"]) == pytest.approx(acc, rel=1e-7)
    assert float(m["preference_loss"]) == pytest.approx(pref, rel=1e-7)


@pytest.mark.parametrize("fn", [NLLLoss(), ClippedPGLoss(reference_policy_kl_penalty=0.1),
                                ClippedPGLoss(token_level_loss=False), DPOLoss(sft_loss_weight=1.0)],
                         ids=["nll", "pg_token", "pg_seq", "dpo"])
def test_micro_batch_shares_sum_to_the_global_loss(fn):
    logp, batch = _batch(3)
    gvs, gvt = _counts(batch)
    whole, m_whole = fn(logp, batch, gvs, gvt)
    parts = [fn(logp[i:i + 2], {k: v[i:i + 2] for k, v in batch.items()}, gvs, gvt)
             for i in range(0, B, 2)]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), rel=1e-12)
    for k, v in m_whole.items():
        assert float(sum(p[1][k] for p in parts)) == pytest.approx(float(v), rel=1e-12, abs=1e-15)


def test_loss_errors_name_the_missing_key():
    logp, batch = _batch()
    del batch["advantages"]
    with pytest.raises(ValueError, match="advantages"):
        ClippedPGLoss()(logp, batch, 1.0, 1.0)
    with pytest.raises(ValueError, match="kl_type"):
        ClippedPGLoss(kl_type="k4")
