"""``hybridtrain dpo``: Direct Preference Optimization of a recipe's model on preference pairs.

    hybridtrain dpo -c examples/dpo_tiny.yaml

The recipe is a finetune recipe (model, tokenizer, optimizer, lr_scheduler, distributed, ...)
whose ``dataset`` / ``validation_dataset`` build a :class:`~hybridtrain.data.PreferenceDataset`
(TRL's prompt/chosen/rejected JSONL, see ``data/preference.py``), plus a ``dpo:`` section
(:class:`~hybridtrain.rl.losses.DPOLoss`'s options). A step takes ``training.global_batch_size``
pairs (micro-batches of ``training.micro_batch_size`` pairs), the frozen reference being the
model as the recipe builds it. ``training.jsonl`` logs ``loss``, ``accuracy`` (pairs the policy
prefers the right way, measured on the step's batch before its update), ``reward_margin`` and
the rest of the loss's metrics; validation (``val_every_steps`` and at the end) the same on the
validation pairs. ``loss.png`` shows loss and accuracy. The pairs' order (its generator and the
pairs left of the current pass) goes into every checkpoint, so a run resumed with
``checkpoint.resume`` (see :mod:`~hybridtrain.recipes.rl_run`) takes the uninterrupted run's pairs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybridtrain.config.sections import recipe_config
from hybridtrain.data.preference import preference_batch
from hybridtrain.distributed.init import process_group
from hybridtrain.recipes.rl_run import fmt, mean_of, rl_run
from hybridtrain.rl.batch import prepare
from hybridtrain.rl.losses import DPOLoss
from hybridtrain.training.builder import instantiate_with
from hybridtrain.training.rng import generator_state, set_generator_state

__all__ = ["run", "evaluate"]


def _with_reference(batch: dict, reference) -> dict:
    return {**batch, "reference_policy_logprobs": F.pad(reference.logprobs(batch), (1, 0))}


@torch.no_grad()
def evaluate(policy, reference, dataset, loss_fn, pairs_per_batch: int) -> dict[str, float]:
    """The loss and its metrics over the whole ``dataset`` (shares of the dataset's counts)."""
    n = len(dataset)
    gvs = 2.0 * n
    totals: dict[str, float] = {}
    for start in range(0, n, pairs_per_batch):
        batch = _with_reference(preference_batch([dataset[i] for i in range(
            start, min(start + pairs_per_batch, n))]), reference)
        full = prepare(batch, policy.device)
        gvt = float((full["token_mask"][:, 1:]).sum())  # token-level terms: this batch's share
        loss, metrics = loss_fn(policy.logprobs(batch), full, gvs, gvt)
        for k, v in {"loss": loss, **metrics}.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return {f"val_{k}": v for k, v in totals.items()}


def run(cfg: Any) -> dict[str, Any]:
    cfg = recipe_config(cfg)
    if cfg.dataset is None:
        raise ValueError(f"the recipe has no dataset section ({cfg.source_file}); DPO needs "
                         "preference pairs (hybridtrain.data.build_preference_dataset)")
    with process_group(cfg), rl_run(cfg, "dpo", plot_extra=("accuracy",),
                                    loss_label="DPO loss") as r:
        tok = r.policy.tokenizer
        train_ds = instantiate_with(cfg.dataset, tokenizer=tok)
        val_ds = instantiate_with(cfg.validation_dataset, tokenizer=tok)
        loss_fn = DPOLoss(**cfg.dpo.to_dict())
        t = cfg.training
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
        steps = t.max_steps or max(1, int(t.num_epochs * len(train_ds)) // t.global_batch_size)
        g = torch.Generator().manual_seed(t.seed)
        order: list[int] = []

        def loop_state() -> dict:  # the data order: a resumed run takes the same pairs
            return {"generator": generator_state(g), "order": order}

        saved = r.begin(loop_state, steps, t.global_batch_size)
        if saved:
            set_generator_state(g, saved["generator"])
            order = saved["order"]

        def validate(step: int) -> None:
            if val_ds is not None:
                rec = {"step": step, **evaluate(r.policy, r.reference, val_ds, loss_fn,
                                                 t.global_batch_size)}
                r.log_val(rec)

        if r.step == 0:
            validate(0)
        for step in range(r.step + 1, steps + 1):
            while len(order) < t.global_batch_size:
                order += torch.randperm(len(train_ds), generator=g).tolist()
            idx, order = order[: t.global_batch_size], order[t.global_batch_size:]
            batch = _with_reference(preference_batch([train_ds[i] for i in idx], pad), r.reference)
            rec = r.train(batch, loss_fn, micro_batch_size=2 * t.micro_batch_size)
            r.log({"step": step, **rec})
            if step == steps or (t.val_every_steps and step % t.val_every_steps == 0):
                validate(step)
            r.stop_if_requested(last=step == steps)

        def headline(hist):
            first, last = mean_of(hist[:5], "accuracy"), mean_of(hist[-5:], "accuracy")
            val = [v for v in r.val_history if "val_accuracy" in v]
            return (f"{len(hist)} steps; preference accuracy (5-step mean) {fmt(first, '.2f')} -> "
                    f"{fmt(last, '.2f')}"
                    + (f", validation {val[0]['val_accuracy']:.2f} -> {val[-1]['val_accuracy']:.2f}"
                       if val else ""))

        return r.finish(headline)
