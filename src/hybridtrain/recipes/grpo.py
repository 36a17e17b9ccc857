"""``hybridtrain grpo``: Group Relative Policy Optimization on a verifiable task.

    hybridtrain grpo -c examples/grpo_tiny.yaml

A finetune recipe (model, tokenizer, optimizer, ...) plus a ``grpo:`` section. Each step:

1. the Policy's weights go to the rollout engine (a plain copy of the model, loaded from
   :meth:`~hybridtrain.rl.Policy.state_dict_full`), which samples ``num_generations_per_prompt``
   completions for each of ``num_prompts_per_step`` task prompts (the model's ``generate``);
2. the task scores them; advantages are the rewards centred (and scaled by the std) within each
   prompt's group, on every generated token;
3. ``prev_logprobs`` (the Policy before the update) and the frozen reference's log-probs;
4. ``updates_per_rollout`` optimizer steps with :class:`~hybridtrain.rl.losses.ClippedPGLoss`
   (the KL term to the reference with ``reference_policy_kl_penalty``), each on its share of the
   prompt groups.

``training.jsonl`` logs per step ``reward`` (mean), ``reward_std``, ``loss``, ``kl``,
``clip_fraction``, ``entropy``, ``ratio``, ``grad_norm``, ``lr``, ``completion_tokens``;
``loss.png`` shows loss and reward. Every rank runs the same rollouts (same weights, same seed),
so the global batch is the same on every rank, as the Policy expects.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F

from hybridtrain.config import instantiate
from hybridtrain.training.builder import as_config
from hybridtrain.recipes.rl_run import RLRun, mean_of

__all__ = ["run", "rollout_batch", "group_advantages"]


def group_advantages(rewards: torch.Tensor, group: int, normalize: bool = True) -> torch.Tensor:
    """``(R − mean(group)) / (std(group) + 1e-6)`` per sample (groups of ``group`` consecutive
    samples); without ``normalize`` only centred."""
    r = rewards.view(-1, group)
    a = r - r.mean(dim=1, keepdim=True)
    if normalize:
        a = a / (r.std(dim=1, keepdim=True) + 1e-6) if group > 1 else a
    return a.reshape(-1)


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.tensor(r)
        mask[i, L - len(r):] = 1
    return ids, mask


def rollout_batch(prompt_ids: list[list[int]], completions: torch.Tensor, eos: int | None,
                  pad: int) -> tuple[dict, list[list[int]]]:
    """The RL batch of prompts + their completions (cut after the first ``eos``), right-padded,
    ``token_mask`` on the completion tokens; and the completion token lists."""
    rows, outs = [], []
    for p, c in zip(prompt_ids, completions.tolist()):
        if eos is not None and eos in c:
            c = c[: c.index(eos) + 1]
        outs.append(c)
        rows.append((p + c, len(p)))
    S = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), S), pad, dtype=torch.long)
    token_mask = torch.zeros(len(rows), S)
    for i, (r, n) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        token_mask[i, n: len(r)] = 1
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r, _ in rows]),
            "token_mask": token_mask, "sample_mask": torch.ones(len(rows))}, outs


def run(cfg: Any) -> dict[str, Any]:
    from hybridtrain.distributed.init import process_group
    from hybridtrain.rl.losses import ClippedPGLoss
    from hybridtrain.rl.tasks import CountingTask

    cfg = as_config(cfg)
    g, t = cfg.grpo, cfg.training
    with process_group(cfg):
        r = RLRun(cfg, "grpo", plot_extra=("reward",), loss_label="clipped policy-gradient loss + KL")
        tok = r.policy.tokenizer
        if tok is None:
            raise ValueError(f"the recipe has no tokenizer section ({cfg.source_file}); GRPO "
                             "turns task prompts into tokens and completions back into text")
        task = instantiate(g.task) if g.task else CountingTask()
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        engine = instantiate(cfg.model).to(r.policy.device).eval()
        loss_fn = ClippedPGLoss(
            ratio_clip_min=g.ratio_clip_min, ratio_clip_max=g.ratio_clip_max,
            ratio_clip_c=g.ratio_clip_c, reference_policy_kl_penalty=g.reference_policy_kl_penalty,
            kl_type=g.kl_type, token_level_loss=g.token_level_loss)
        P, G, U = g.num_prompts_per_step, g.num_generations_per_prompt, g.updates_per_rollout
        if P % U:
            raise ValueError(f"grpo.num_prompts_per_step={P} must be a multiple of "
                             f"grpo.updates_per_rollout={U} (each update takes whole groups)")
        rng = random.Random(t.seed)
        for step in range(1, (t.max_steps or 1) + 1):
            prompts = task.prompts(P, rng)
            prompt_ids = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts
                          for _ in range(G)]
            engine.load_state_dict(r.policy.state_dict_full())
            ids, mask = _left_pad(prompt_ids, pad)
            out = engine.generate(ids, mask, max_new_tokens=g.max_new_tokens, do_sample=True,
                                  temperature=g.temperature, eos_token_id=tok.eos_token_id,
                                  seed=t.seed * 100003 + step)
            batch, comps = rollout_batch(prompt_ids, out[:, ids.shape[1]:], tok.eos_token_id, pad)
            rewards = torch.tensor([task.reward(p, tok.decode(c, skip_special_tokens=True))
                                    for p, c in zip((p for p in prompts for _ in range(G)), comps)])
            adv = group_advantages(rewards, G, g.normalize_rewards)
            batch["advantages"] = adv[:, None].expand_as(batch["token_mask"]).clone()
            batch["prev_logprobs"] = F.pad(r.policy.logprobs(batch), (1, 0))
            batch["reference_policy_logprobs"] = F.pad(r.reference.logprobs(batch), (1, 0))
            rows = P * G // U
            recs = [r.policy.train({k: v[i * rows:(i + 1) * rows] for k, v in batch.items()},
                                   loss_fn) for i in range(U)]
            rec = {k: sum(x[k] for x in recs) / U for k in recs[0] if k != "skipped"}
            r.log({"step": step, "reward": float(rewards.mean()),
                   "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0, **rec,
                   "completion_tokens": float(batch["token_mask"].sum()) / len(comps),
                   "skipped_updates": sum(x["skipped"] for x in recs)})

        def headline(hist):
            first, last = mean_of(hist[:5], "reward"), mean_of(hist[-5:], "reward")
            return f"{len(hist)} steps; reward (5-step mean) {first:.3f} -> {last:.3f}"

        return r.finish(headline)
