"""``hybridtrain grpo``: Group Relative Policy Optimization on a verifiable task.

    hybridtrain grpo -c examples/grpo_tiny.yaml

A finetune recipe (model, tokenizer, optimizer, ...) plus a ``grpo:`` section. Each step:

1. the Policy's weights go to the rollout engine (a plain copy of the model on every rank,
   loaded from :meth:`~hybridtrain.rl.Policy.state_dict_full`), which samples
   ``num_generations_per_prompt`` completions for each of ``num_prompts_per_step`` task prompts
   (the model's ``generate``, one call per rank); each data-parallel rank samples and scores its
   contiguous share of the prompt groups (groups stay whole), and the shares are gathered over the
   data-parallel group, so every rank holds the global batch the Policy expects. The engine is
   local (no collectives), so this holds under every layout; the ranks of one data-parallel
   rank (tp, cp, pp peers) sample the same share;
2. the task scores them; advantages are the rewards centred (and scaled by the std) within each
   prompt's group, on every generated token;
3. ``prev_logprobs`` (the Policy before the update) and the frozen reference's log-probs;
4. ``updates_per_rollout`` optimizer steps with :class:`~hybridtrain.rl.losses.ClippedPGLoss`
   (the KL term to the reference with ``reference_policy_kl_penalty``), each on its share of the
   prompt groups.

A step is one rollout (``training.max_steps`` of them); it makes ``updates_per_rollout`` optimizer
updates. ``training.jsonl``, the summary and the final ``step_N/`` (with ``final`` linking to it)
count steps, not updates; the LR schedule counts updates (its decay length, unless
``lr_scheduler:`` gives one: ``max_steps × updates_per_rollout``).

``training.jsonl`` logs per step ``reward`` (mean), ``reward_std``, ``accuracy`` (when the task
has one), ``loss``, ``kl``,
``clip_fraction``, ``entropy``, ``ratio``, ``grad_norm``, ``lr``, ``completion_tokens``,
``skipped_updates`` (and ``nonfinite_rewards`` in a step that had any); ``loss.png`` shows loss
and reward.

A task's interface is checked where it enters (its methods, that ``prompts`` gives strings and
``reward`` numbers). The first non-finite reward or advantage is named in a warning (task, reward
function, sample, prompt); its updates are non-finite and skipped, and
``training.max_consecutive_skipped_steps`` skipped updates in a row stop the run (exit status 3,
nothing exported).

Seeding: the step's prompts come from ``random.Random(training.seed)`` (the same on every rank),
and sample ``i`` of the step's ``P·G`` (group-major) is drawn with a generator of its own seeded
by :func:`rollout_seed` ``(training.seed, step, i)``, so the rollouts do not depend on how many
ranks share them out: any layout samples what one process samples. The prompt generator's state
goes into every checkpoint, so a run resumed with ``checkpoint.resume`` (see
:mod:`~hybridtrain.recipes.rl_run`) draws and samples what the uninterrupted run does.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch
import torch.nn.functional as F

from hybridtrain.config import instantiate
from hybridtrain.config.sections import recipe_config
from hybridtrain.data.preference import response_batch
from hybridtrain.distributed.init import process_group
from hybridtrain.models.spec import Decoding, model_spec_for
from hybridtrain.recipes.rl_run import fmt, mean_of, rl_run
from hybridtrain.rl.losses import ClippedPGLoss
from hybridtrain.rl.tasks import CountingTask, check_task, method_name, score, task_prompts
from hybridtrain.training.evaluation import left_pad
from hybridtrain.training.rng import generator_state, set_generator_state

logger = logging.getLogger(__name__)

__all__ = ["run", "rollout_batch", "group_advantages", "rollout_seed", "sample_rollouts",
           "first_nonfinite"]


def rollout_seed(seed: int, step: int, sample: int) -> int:
    """The sampling seed of sample ``sample`` (group-major index) of step ``step``."""
    return ((seed * 1_000_003 + step) * 1_000_003 + sample) % 2 ** 63


def group_advantages(rewards: torch.Tensor, group: int, normalize: bool = True) -> torch.Tensor:
    """``(R − mean(group)) / (std(group) + 1e-6)`` per sample (groups of ``group`` consecutive
    samples); without ``normalize`` only centred."""
    r = rewards.view(-1, group)
    a = r - r.mean(dim=1, keepdim=True)
    if normalize:
        a = a / (r.std(dim=1, keepdim=True) + 1e-6) if group > 1 else a
    return a.reshape(-1)


def rollout_batch(prompt_ids: list[list[int]], completions: torch.Tensor | list[list[int]],
                  eos: int | None, pad: int) -> tuple[dict, list[list[int]]]:
    """The RL batch of prompts + their completions (cut after the first ``eos``), right-padded,
    ``token_mask`` on the completion tokens; and the completion token lists."""
    if isinstance(completions, torch.Tensor):
        completions = completions.tolist()
    outs = [c[: c.index(eos) + 1] if eos is not None and eos in c else c for c in completions]
    return response_batch([(p + c, len(p)) for p, c in zip(prompt_ids, outs)], pad), outs


def sample_rollouts(engine, tok, task, prompts: list[str], group: int, *, seed: int, step: int,
                    dims=None, max_new_tokens: int = 8, temperature: float = 1.0,
                    speculative=None, draft_tokens: int = 3) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(batch, scores)`` of the step's prompts, the same on every rank: this data-parallel
    rank (``dims``: ``dp``, ``dp_rank``, ``dp_group``; None: one process) samples and scores its
    contiguous share of the prompt groups with ``engine.generate``, and the shares are gathered
    (see the module docstring). ``scores``: ``reward`` [P·G] (``task.reward``), and
    ``accuracy`` [P·G] when the task has an ``accuracy(prompt, completion)`` (e.g. the exact
    answers of a task whose reward gives partial credit). ``speculative``: the model family's
    ``Decoding.speculative`` to sample each row with (``draft_tokens`` drafts per round; the
    same distribution as ``engine.generate``'s, other draws), None: ``engine.generate``."""
    P = len(prompts)
    dp, rank = (dims.dp, dims.dp_rank) if dims is not None else (1, 0)
    if P % dp:
        raise ValueError(f"grpo.num_prompts_per_step={P} must be a multiple of the data-parallel "
                         f"size {dp} (each rank samples whole prompt groups)")
    lo, hi = rank * P // dp, (rank + 1) * P // dp
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompt_ids = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    rows = [prompt_ids[j] for j in range(lo, hi) for _ in range(group)]
    seeds = [rollout_seed(seed, step, i) for i in range(lo * group, hi * group)]
    if speculative is None:
        ids, mask = left_pad(rows, pad, max(map(len, prompt_ids)))  # the same shape on every rank
        out = engine.generate(ids, mask, max_new_tokens=max_new_tokens, do_sample=True,
                              temperature=temperature, eos_token_id=tok.eos_token_id, seed=seeds)
        out = out[:, ids.shape[1]:]
    else:
        device = next(engine.parameters()).device
        out = [speculative(engine, torch.tensor([r], device=device), max_new_tokens, draft_tokens,
                           tok.eos_token_id, temperature=temperature, seed=s)[0][0, len(r):].tolist()
               for r, s in zip(rows, seeds)]
    _, comps = rollout_batch(rows, out, tok.eos_token_id, pad)
    fns = {"reward": task.reward}
    if callable(getattr(task, "accuracy", None)):
        fns["accuracy"] = task.accuracy
    texts = [tok.decode(c, skip_special_tokens=True) for c in comps]
    scores = {k: [score(fn, prompts[lo + i // group], x, lo * group + i)
                  for i, x in enumerate(texts)] for k, fn in fns.items()}
    shares = [(comps, scores)]
    if dp > 1:
        import torch.distributed as dist

        shares = [None] * dp
        dist.all_gather_object(shares, (comps, scores), group=dims.dp_group)
    comps = [c for share in shares for c in share[0]]
    scores = {k: torch.tensor([v for share in shares for v in share[1][k]], dtype=torch.float32)
              for k in fns}
    rows = [p for p in prompt_ids for _ in range(group)]
    return response_batch([(p + c, len(p)) for p, c in zip(rows, comps)], pad), scores


def first_nonfinite(task, rewards: torch.Tensor, adv: torch.Tensor, prompts: list[str],
                    group: int, step: int) -> str | None:
    """What names the first non-finite reward or advantage of a step (task, reward function,
    sample index, prompt), or None when all are finite."""
    for what, values in (("reward", rewards), ("advantage", adv)):
        bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            return (f"step {step}: {len(bad)} of {len(values)} {what}s are not finite, the "
                    f"first sample {i} ({what} {float(values[i])}, prompt "
                    f"{prompts[i // group]!r:.80}) of task {type(task).__qualname__}, reward "
                    f"function {method_name(task.reward)}; a non-finite reward or advantage "
                    "makes its update non-finite, and such updates are skipped")
    return None


def run(cfg: Any) -> dict[str, Any]:
    cfg = recipe_config(cfg)
    g, t = cfg.grpo, cfg.training
    task = instantiate(g.task) if g.task else CountingTask()
    check_task(task, f"grpo.task ({cfg.source_file})")
    with process_group(cfg), rl_run(cfg, "grpo", plot_extra=("reward", "accuracy"),
                                    loss_label="clipped policy-gradient loss + KL") as r:
        tok = r.policy.tokenizer
        if tok is None:
            raise ValueError(f"the recipe has no tokenizer section ({cfg.source_file}); GRPO "
                             "turns task prompts into tokens and completions back into text")
        engine = instantiate(cfg.model).to(r.policy.device).eval()
        speculative = None
        if g.speculative:
            speculative = model_spec_for(engine).part(Decoding, "grpo.speculative").speculative
            if speculative is None:
                raise ValueError(f"grpo.speculative={g.speculative!r} ({cfg.source_file}): the model "
                                 f"family {model_spec_for(engine).name!r} has no speculative decoding; "
                                 "set it to null")
        loss_fn = ClippedPGLoss(
            ratio_clip_min=g.ratio_clip_min, ratio_clip_max=g.ratio_clip_max,
            ratio_clip_c=g.ratio_clip_c, reference_policy_kl_penalty=g.reference_policy_kl_penalty,
            kl_type=g.kl_type, token_level_loss=g.token_level_loss)
        P, G, U = g.num_prompts_per_step, g.num_generations_per_prompt, g.updates_per_rollout
        rng = random.Random(t.seed)
        bad_note = None  # the first non-finite reward / advantage, named once

        def loop_state() -> dict:  # the prompts drawn so far: a resumed run draws the same
            return {"prompt_rng": generator_state(rng), "bad_note": bad_note}

        steps = t.max_steps or 1
        saved = r.begin(loop_state, steps, P * G // U, updates_per_step=U)
        if saved:
            set_generator_state(rng, saved["prompt_rng"])
            bad_note = saved["bad_note"]
        for step in range(r.step + 1, steps + 1):
            prompts = task_prompts(task, P, rng)
            engine.load_state_dict(r.policy.state_dict_full())
            batch, scores = sample_rollouts(
                engine, tok, task, prompts, G, seed=t.seed, step=step, dims=r.policy.dims,
                max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                speculative=speculative, draft_tokens=g.draft_tokens)
            rewards = scores["reward"]
            adv = group_advantages(rewards, G, g.normalize_rewards)
            note = first_nonfinite(task, rewards, adv, prompts, G, step)
            if note is not None and bad_note is None:
                bad_note = note
                logger.warning("grpo: %s", note)
            batch["advantages"] = adv[:, None].expand_as(batch["token_mask"]).clone()
            batch["prev_logprobs"] = F.pad(r.policy.logprobs(batch), (1, 0))
            batch["reference_policy_logprobs"] = F.pad(r.reference.logprobs(batch), (1, 0))
            rows = P * G // U
            recs = [r.train({k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}, loss_fn,
                            bad_note) for i in range(U)]
            rec = {k: sum(x[k] for x in recs) / U for k in recs[0] if k != "skipped"}
            r.log({"step": step, "reward": float(rewards.mean()),
                   "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
                   **({"accuracy": float(scores["accuracy"].mean())} if "accuracy" in scores else {}),
                   **rec,
                   "completion_tokens": float(batch["token_mask"].sum()) / len(rewards),
                   "skipped_updates": sum(x["skipped"] for x in recs),
                   **({"nonfinite_rewards": int((~torch.isfinite(rewards)).sum())}
                      if note is not None else {})})
            r.stop_if_requested(last=step == steps)

        def headline(hist):
            first, last = mean_of(hist[:5], "reward"), mean_of(hist[-5:], "reward")
            bad = sum(1 for h in hist if h.get("nonfinite_rewards"))
            return (f"{len(hist)} steps; reward (5-step mean) {fmt(first)} -> {fmt(last)}"
                    + (f"; {bad} steps had non-finite rewards, left out of the means (see the "
                       "warning)" if bad else ""))

        return r.finish(headline)
