"""RL losses on per-token log-probabilities: NLL, clipped policy gradient (PPO / GRPO), DPO.

NeMo-RL's definitions and configuration names (see docs/rl.md). A loss is
called once per micro-batch::

    loss, metrics = loss_fn(logprobs, batch, global_valid_seqs, global_valid_toks)

* ``logprobs`` ``[b, S-1]`` fp32, differentiable: ``logprobs[:, t] = log p(input_ids[:, t+1] |
  input_ids[:, :t+1])`` of the micro-batch's rows;
* ``batch``: the micro-batch's rows (``input_ids [b, S]``, ``token_mask [b, S]``, ``sample_mask
  [b]``, per-token ``advantages``, ``prev_logprobs``, ``generation_logprobs``,
  ``reference_policy_logprobs`` ``[b, S]``, all indexed by input position: used ``[:, 1:]``);
* ``global_valid_seqs`` / ``global_valid_toks``: ``Σ sample_mask`` and ``Σ token_mask[:, 1:] ·
  sample_mask`` over the *whole global batch* (every micro-batch, every data-parallel rank).

The returned loss is this micro-batch's share of the global loss (its partial sum divided by the
global count), so the sum over micro-batches and ranks is the exact global mean. ``metrics``
(detached scalars) are shares in the same sense: summed over micro-batches and ranks they are the
global values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["NLLLoss", "ClippedPGLoss", "DPOLoss", "masked_mean"]

_EPS = 1e-8


def masked_mean(values: torch.Tensor, mask: torch.Tensor, denom) -> torch.Tensor:
    """``Σ(values·mask) / (denom + 1e-8)``: a share of a global mean when ``denom`` is the global
    count."""
    return (values * mask).sum() / (denom + _EPS)


def _masks(batch: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_mask[:, 1:], sample_mask, their product) in ``dtype`` (the log-probs')."""
    tm = batch["token_mask"][:, 1:].to(dtype)
    sm = batch["sample_mask"].to(dtype)
    return tm, sm, tm * sm[:, None]


def _reduce(values, batch, token_level: bool, gvs, gvt) -> torch.Tensor:
    """Token level: ``Σ ℓ·mask / global_valid_toks``; sequence level: the per-sequence token
    mean, ``Σ sample_mask · mean_t ℓ / global_valid_seqs``."""
    tm, sm, mask = _masks(batch, values.dtype)
    if token_level:
        return masked_mean(values, mask, gvt)
    per_seq = (values * tm).sum(-1) / (tm.sum(-1) + _EPS)
    return masked_mean(per_seq, sm, gvs)


def _require(batch: dict, *keys: str, loss: str) -> None:
    missing = [k for k in keys if batch.get(k) is None]
    if missing:
        raise ValueError(f"{loss}: the batch has no {', '.join(missing)} (per-token tensors "
                         "[B, S] indexed by input position)")


class NLLLoss:
    """``L = −Σ logp·mask / global_valid_toks`` (token level)."""

    rows_per_group = 1

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        _, _, mask = _masks(batch, logprobs.dtype)
        loss = masked_mean(-logprobs, mask, global_valid_toks)
        return loss, {}


class ClippedPGLoss:
    """PPO / GRPO: ``ℓ = max(−A·r, −A·clamp(r, 1−ε_low, 1+ε_high))`` with ``r = exp(logp −
    prev_logprobs)``; dual clip ``min(ℓ, −A·c)`` for ``A < 0`` when ``ratio_clip_c``; optional
    importance weight ``exp(prev − generation logprobs)``; plus ``β·KL`` to the reference policy
    (k1/k2/k3 of ``log_r = clamp(ref − logp, ±20)``, clamped to ±10). Token- or sequence-level.

    Metrics: ``actor_loss``, ``kl``, ``ratio``, ``clip_fraction`` (tokens where the clipped branch
    was taken) and ``entropy`` (``−mean(w·logp)``, ``w = exp(logp − generation logprobs)``
    detached: the sampled-token estimate of the policy's entropy), reduced like the loss."""

    rows_per_group = 1

    def __init__(self, ratio_clip_min: float = 0.2, ratio_clip_max: float = 0.2,
                 ratio_clip_c: float | None = None, reference_policy_kl_penalty: float = 0.0,
                 kl_type: str = "k3", token_level_loss: bool = True,
                 use_importance_sampling_correction: bool = False):
        if kl_type not in ("k1", "k2", "k3"):
            raise ValueError(f"ClippedPGLoss: kl_type must be k1, k2 or k3, got {kl_type!r}")
        if ratio_clip_c is not None and ratio_clip_c <= 1:
            raise ValueError(f"ClippedPGLoss: ratio_clip_c (dual clip) must be > 1, got {ratio_clip_c}")
        self.eps_low, self.eps_high, self.c = ratio_clip_min, ratio_clip_max, ratio_clip_c
        self.beta, self.kl_type, self.token_level = reference_policy_kl_penalty, kl_type, token_level_loss
        self.is_correction = use_importance_sampling_correction

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        _require(batch, "advantages", "prev_logprobs", loss="ClippedPGLoss")
        dt = logprobs.dtype
        adv = batch["advantages"][:, 1:].to(dt)
        prev = batch["prev_logprobs"][:, 1:].to(dt)
        gen = batch.get("generation_logprobs")
        gen = prev if gen is None else gen[:, 1:].to(dt)

        def reduce(v):
            return _reduce(v, batch, self.token_level, global_valid_seqs, global_valid_toks)

        ratio = torch.exp(logprobs - prev)
        clipped = ratio.clamp(1 - self.eps_low, 1 + self.eps_high)
        loss1, loss2 = -adv * ratio, -adv * clipped
        tok = torch.maximum(loss1, loss2)
        if self.c is not None:
            tok = torch.where(adv < 0, torch.minimum(tok, -adv * self.c), tok)
        if self.is_correction:
            if batch.get("generation_logprobs") is None:
                raise ValueError("ClippedPGLoss(use_importance_sampling_correction=True): the "
                                 "batch has no generation_logprobs")
            w = torch.exp(prev - gen)
            tok = tok * torch.where(torch.isfinite(w), w, torch.zeros_like(w))
        actor = reduce(tok)
        kl = torch.zeros((), device=logprobs.device)
        if self.beta:
            _require(batch, "reference_policy_logprobs", loss="ClippedPGLoss with a KL penalty")
            ref = batch["reference_policy_logprobs"][:, 1:].to(dt)
            kl = reduce(kl_penalty(logprobs, ref, self.kl_type))
        loss = actor + self.beta * kl
        with torch.no_grad():
            w_gen = torch.exp(logprobs - gen)
            metrics = {
                "actor_loss": actor.detach(), "kl": kl.detach(), "ratio": reduce(ratio),
                "clip_fraction": reduce((loss2 > loss1).to(dt)),
                "entropy": reduce(-torch.where(torch.isfinite(w_gen), w_gen, 0.0) * logprobs),
            }
        return loss, metrics


def kl_penalty(logprobs: torch.Tensor, reference: torch.Tensor, kl_type: str = "k3") -> torch.Tensor:
    """Per-token KL estimate to the reference policy (``log_r = clamp(ref − logp, ±20)``; k1
    ``−log_r``, k2 ``log_r²/2``, k3 ``exp(log_r) − 1 − log_r``), clamped to ±10."""
    log_r = (reference - logprobs).clamp(-20.0, 20.0)
    if kl_type == "k1":
        kl = -log_r
    elif kl_type == "k2":
        kl = log_r.square() / 2
    else:
        kl = log_r.exp() - 1 - log_r
    return kl.clamp(-10.0, 10.0)


class DPOLoss:
    """DPO on interleaved rows (chosen at even rows, rejected at odd): per row ``r = Σ_t (logp −
    ref)·mask`` (the token mean with ``preference_average_log_probs``); ``L = w_pref · Σ_pairs
    −log σ(β(r_c − r_r))·sample_mask_c / pairs + w_sft · (per-sample NLL of the chosen rows) /
    pairs`` with ``pairs = global_valid_seqs / 2``.

    Metrics: ``accuracy`` (pairs with ``r_c > r_r``), ``reward_margin`` (``β(r_c − r_r)``),
    ``chosen_reward`` / ``rejected_reward`` (``β·r``), ``preference_loss``, ``sft_loss``."""

    rows_per_group = 2  # a chosen/rejected pair never splits across micro-batches or ranks

    def __init__(self, reference_policy_kl_penalty: float = 0.05, preference_loss_weight: float = 1.0,
                 sft_loss_weight: float = 0.0, preference_average_log_probs: bool = False):
        self.beta = reference_policy_kl_penalty
        self.w_pref, self.w_sft = preference_loss_weight, sft_loss_weight
        self.average = preference_average_log_probs

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        _require(batch, "reference_policy_logprobs", loss="DPOLoss")
        if logprobs.shape[0] % 2:
            raise ValueError(f"DPOLoss: {logprobs.shape[0]} rows; chosen and rejected rows come "
                             "in pairs (even rows chosen, odd rows rejected)")
        tm, sm, mask = _masks(batch, logprobs.dtype)
        ref = batch["reference_policy_logprobs"][:, 1:].to(logprobs.dtype)
        r = ((logprobs - ref) * mask).sum(-1)
        if self.average:
            r = r / (mask.sum(-1) + _EPS)
        pairs = global_valid_seqs / 2
        rc, rr, sm_c = r[::2], r[1::2], sm[::2]
        margin = self.beta * (rc - rr)
        pref = masked_mean(-F.logsigmoid(margin), sm_c, pairs)
        nll_c = -(logprobs[::2] * tm[::2]).sum(-1) / (tm[::2].sum(-1) + _EPS)
        sft = masked_mean(nll_c, sm_c, pairs)
        loss = self.w_pref * pref + (self.w_sft * sft if self.w_sft else 0.0)
        with torch.no_grad():
            metrics = {
                "accuracy": masked_mean((rc > rr).to(r.dtype), sm_c, pairs),
                "reward_margin": masked_mean(margin, sm_c, pairs),
                "chosen_reward": masked_mean(self.beta * rc, sm_c, pairs),
                "rejected_reward": masked_mean(self.beta * rr, sm[1::2], pairs),
                "preference_loss": pref.detach(), "sft_loss": sft.detach(),
            }
        return loss, metrics
