"""``Policy``: a recipe's model as the training backend of an RL loop.

    policy = Policy("recipe.yaml", ["--distributed.pp=2"])   # in one process or under torchrun
    logp = policy.logprobs(batch)                              # [B, S-1] on every rank
    metrics = policy.train(batch, ClippedPGLoss(reference_policy_kl_penalty=0.01))
    for name, tensor in policy.state_dict_hf(torch.bfloat16): ...   # Hub names, full tensors

Built by :func:`hybridtrain.training.builder.build` from the recipe's ``model``, ``tokenizer``
(optional), ``peft``, ``training`` (dtype, seed, micro_batch_size, grad_clip, loss_chunk_size),
``optimizer``, ``lr_scheduler``, ``distributed``, ``checkpoint`` and ``rl`` sections; the
model's ``loss`` slot holds a :class:`~hybridtrain.rl.head.PolicyHead`, so every layout runs the
model's own forward and the log-probs come from the final hidden states in chunks.

Every method is collective: every rank calls it with the **same global batch** (a dict of NeMo-RL
keys, see :mod:`hybridtrain.rl.batch`). Each data-parallel rank takes its contiguous share of the
rows (the batch is padded with dummy rows, ``sample_mask`` 0, to a multiple of ``dp ×
micro_batch_size``), runs it in micro-batches (with ``rl.sequence_packing``, each micro-batch's
rows packed into one row), and the results are gathered so that every rank returns the whole
batch's. Under pipeline parallelism the last stage computes and broadcasts. The loss
normalisation uses the global batch's counts, computed from the global batch every rank holds,
so one process and any layout give the same step. Under context parallelism each micro-batch's
model inputs (targets already shifted, packed or not) are cut into the cp ranks' contiguous
slices with the trainer's :func:`~hybridtrain.distributed.context_parallel.shard_batches`; each
rank's head computes its slice's per-token values, which are gathered back along the sequence
(:func:`~hybridtrain.distributed.context_parallel.gather_sequence`, whose backward
reduce-scatters), so every cp rank evaluates the caller's loss on whole rows (losses need not
be sums over tokens, e.g. DPO's) and back-propagates ``1/cp`` of it. Tensor parallelism's ranks
hold the same rows (they are not data-parallel ranks) and reach the log-probs and top-k through
the head's vocabulary-parallel ``token_logprobs`` / ``topk_logits``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridtrain.config import ConfigNode, build_config, load_config, parse_overrides
from hybridtrain.config.sections import RecipeConfig, recipe_config
from hybridtrain.distributed.context_parallel import ContextParallel, gather_sequence, shard_batches
from hybridtrain.distributed.init import init_distributed
from hybridtrain.rl import batch as rb
from hybridtrain.rl.head import PolicyHead
from hybridtrain.rl.pipeline import PolicyPipeline
from hybridtrain.rl.weights import full_state_dict, hf_tensors
from hybridtrain.training.builder import build, build_checkpointer, build_lr_scheduler
from hybridtrain.training.precision import autocast_context
from hybridtrain.training.trainer import TrainingDiverged

logger = logging.getLogger(__name__)

__all__ = ["Policy"]

LossFn = Callable[[torch.Tensor, dict, float, float], tuple[torch.Tensor, dict]]


def _load(recipe: Any, overrides) -> RecipeConfig:
    """The typed recipe of a path, a dict, a loaded tree or a typed recipe, with ``overrides``."""
    ov = parse_overrides(overrides or ())
    if isinstance(recipe, RecipeConfig) and not ov:
        return recipe
    if isinstance(recipe, RecipeConfig):
        recipe = recipe.node
    if isinstance(recipe, ConfigNode):
        return recipe_config(build_config(recipe.to_dict(), ov,
                                          source=recipe.source_file or "<config>"))
    if isinstance(recipe, (str, os.PathLike)):
        return recipe_config(load_config(recipe, ov))
    if isinstance(recipe, Mapping):
        return recipe_config(build_config(dict(recipe), ov))
    raise ValueError(f"Policy: expected a recipe path, a loaded config or a dict, got {type(recipe)}")


class Policy:
    """A recipe's model, optimizer and LR schedule with RL entry points (see module docstring).

    ``recipe``: a YAML path, a dict or a loaded config; ``overrides``: ``["--a.b=c", ...]`` or
    ``{"a.b": c}``. Starts the process group when launched with several ranks (torchrun) and
    none is running."""

    def __init__(self, recipe: Any, overrides: Sequence[str] | Mapping[str, Any] | None = None):
        cfg = _load(recipe, overrides)
        t = cfg.training
        backend = None if cfg.distributed.backend == "auto" else cfg.distributed.backend
        info = init_distributed(None if t.device == "auto" else t.device, backend,
                                cfg.distributed.timeout_seconds / 60)
        self.cfg = cfg
        self.head = PolicyHead(chunk_size=t.loss_chunk_size)
        self.built = b = build(cfg, info.device, info.is_main, info.world_size, data=False,
                               loss=self.head, tokenizer=True)
        self.model, self.optimizer, self.device = b.model, b.optimizer, b.device
        if b.aux_loss is not None or (b.expert_load is not None and b.expert_load.rate):
            logger.warning(
                "the policy trains on the RL losses only: the model's extra objectives (%s) and the "
                "routers' bias update are not applied here, their layers and biases stay as "
                "loaded (set training.mtp: freeze, training.moe_aux_loss_coeff: 0 and "
                "training.moe_bias_update_rate: 0 to say so)",
                ", ".join(b.aux_loss.names) if b.aux_loss is not None else "none")
        self.tokenizer, self.dims = b.tokenizer, b.plan.dims
        self._run_length = (t.max_steps, t.global_batch_size)  # see set_run_length()
        self._lr_scheduler = None  # made on first use
        self.micro_batch_size = cfg.rl.micro_batch_size or t.micro_batch_size
        self.packing, self.pad_multiple = cfg.rl.sequence_packing, cfg.rl.pad_to_multiple_of
        self.autocast_dtype = b.plan.autocast_dtype
        self.pipeline = None
        if b.plan.pipeline is not None:
            self.pipeline = PolicyPipeline(b.plan.pipeline)
        self.cp = ContextParallel(self.dims.group("cp")) if self.dims.cp > 1 else None
        self.step = 0
        self.skipped_streak = 0  # consecutive updates skipped for a non-finite loss / norm

    def set_run_length(self, updates: int | None, samples_per_update: int) -> None:
        """The LR schedule over a run of ``updates`` optimizer updates of ``samples_per_update``
        samples each (its decay length when ``lr_scheduler:`` gives none). Default:
        ``training.max_steps`` updates of ``training.global_batch_size``; a loop that makes
        several updates per step (GRPO) or counts its steps in epochs (DPO) says so before
        its first update."""
        assert self._lr_scheduler is None, "set_run_length() comes before the first update"
        self._run_length = (updates, samples_per_update)

    @property
    def lr_scheduler(self):
        """The LR schedule (:meth:`set_run_length`), made on first use."""
        if self._lr_scheduler is None:
            self._lr_scheduler = build_lr_scheduler(self.cfg, self.optimizer, *self._run_length)
        return self._lr_scheduler

    # -- layout --------------------------------------------------------------------------------

    def _shard(self, batch: dict, micro_batch_size: int | None, rows_per_group: int = 1
               ) -> tuple[dict, list[dict]]:
        """(the prepared global batch, this rank's micro-batches of rows)."""
        mbs = micro_batch_size or self.micro_batch_size
        if mbs % rows_per_group:
            key = ("micro_batch_size" if micro_batch_size else "rl.micro_batch_size"
                   if self.cfg.rl.micro_batch_size else "training.micro_batch_size")
            raise ValueError(f"{key}={mbs} rows must be a multiple of {rows_per_group} (the "
                             "loss's rows per group, e.g. a DPO chosen/rejected pair)")
        full = rb.prepare(batch, self.device)
        dp = self.dims.dp
        padded = rb.pad_rows(full, dp * mbs)
        n = padded["input_ids"].shape[0]
        share = n // dp
        mine = rb.take_rows(padded, self.dims.dp_rank * share, (self.dims.dp_rank + 1) * share)
        return full, [rb.take_rows(mine, i, i + mbs) for i in range(0, share, mbs)]

    def _inputs(self, micro: list[dict]) -> list[dict]:
        """The model inputs of every micro-batch (this cp rank's slices under context parallelism)."""
        inputs = [rb.model_rows(mb, self.packing, self.pad_multiple) for mb in micro]
        if self.cp is None:
            return inputs
        return shard_batches(inputs, self.cp.rank, self.cp.size)

    def _whole(self, out: torch.Tensor) -> torch.Tensor:
        """Per-position outputs of this cp rank's slice -> of the whole rows (autograd-aware)."""
        return out if self.cp is None else gather_sequence(out, 1, self.cp)

    def _run_model(self, inputs: dict) -> torch.Tensor:
        kw = {"position_ids": inputs["position_ids"]} if "position_ids" in inputs else {}
        with autocast_context(self.autocast_dtype, self.device):
            return self.model(inputs["input_ids"], labels=inputs["labels"], **kw)

    def _gather_dp(self, local: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's rows -> every rank's, in rank order."""
        if self.dims.dp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.dims.dp)]
        dist.all_gather(parts, local.contiguous(), group=self.dims.dp_group)
        return torch.cat(parts)

    @torch.no_grad()
    def _forward(self, batch: dict, trailing: tuple[int, ...]) -> torch.Tensor:
        """The head's per-position outputs ``[B, S, *trailing]`` of the whole batch, every rank."""
        full, micro = self._shard(batch, None)
        was_training = self.model.training
        self.model.eval()
        try:
            inputs = self._inputs(micro)
            if self.pipeline is not None:
                with autocast_context(self.autocast_dtype, self.device):
                    outs = self.pipeline.forward(inputs, trailing)
            else:
                outs = [self._run_model(x).float() for x in inputs]
        finally:
            self.model.train(was_training)
        local = torch.cat([rb.unpack(self._whole(o), mb, self.packing) for o, mb in zip(outs, micro)])
        return self._gather_dp(local)[: full["input_ids"].shape[0]]

    # -- the API -------------------------------------------------------------------------------
    def logprobs(self, batch: dict) -> torch.Tensor:
        """``[B, S-1]`` fp32: ``log p(input_ids[:, t+1] | input_ids[:, :t+1])``, 0 from each row's
        ``input_lengths - 1`` on. Collective; every rank returns the whole batch's."""
        return self._forward(batch, ())[:, :-1].contiguous()

    def topk_logits(self, batch: dict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values [B, S, k] fp32, indices [B, S, k] int64)``: the ``k`` largest logits at every
        position (0 past each row's length), largest first. Collective."""
        vocab = self.built.model_config.vocab_size
        if not 0 < k <= vocab:
            raise ValueError(f"topk_logits: k must be in 1..{vocab} (the vocabulary), got {k}")
        with self.head.top_k(k):
            out = self._forward(batch, (2 * k,))
        return out[..., :k].contiguous(), out[..., k:].round().long()

    def train(self, batch: dict, loss_fn: LossFn, micro_batch_size: int | None = None
              ) -> dict[str, float]:
        """One optimizer step over the whole batch with ``loss_fn`` (see
        :mod:`hybridtrain.rl.losses`), normalised by the global batch's counts. Returns ``loss``
        (the global loss), ``grad_norm`` (before clipping), ``lr`` (of this step), the loss's
        metrics (global values), ``num_valid_seqs`` / ``num_valid_tokens`` and ``skipped``
        (a non-finite loss or gradient norm: no update, the LR schedule does not move). After
        ``training.max_consecutive_skipped_steps`` skipped updates in a row it raises
        :class:`~hybridtrain.training.trainer.TrainingDiverged` (the run exports nothing)."""
        full, micro = self._shard(batch, micro_batch_size, getattr(loss_fn, "rows_per_group", 1))
        gvs, gvt = rb.global_counts(full)
        sums: dict[str, torch.Tensor] = {}

        def finish(i: int, out: torch.Tensor) -> torch.Tensor:
            rows = micro[i]
            logp = rb.unpack(self._whole(out.float()), rows, self.packing)[:, :-1]
            loss, metrics = loss_fn(logp, rows, gvs, gvt)
            for k, v in {"loss": loss, **metrics}.items():
                v = torch.as_tensor(v, dtype=torch.float64, device=self.device).detach()
                sums[k] = sums[k] + v if k in sums else v
            # every cp rank holds the whole loss; the gather's backward sums their gradients
            return loss if self.cp is None else loss / self.cp.size

        lr = self.lr_scheduler.get_lr()  # the lr this update uses (the schedule sets it)
        self.model.train()
        inputs = self._inputs(micro)
        if self.pipeline is not None:
            with autocast_context(self.autocast_dtype, self.device):
                self.pipeline.train(inputs, finish)
        else:
            sync = getattr(self.model, "set_requires_gradient_sync", None)  # FSDP2: once
            for i, x in enumerate(inputs):
                if sync is not None:
                    sync(i == len(inputs) - 1)
                finish(i, self._run_model(x)).backward()
        metrics = self._reduce_metrics(sums)
        grad_norm = float(self.built.plan.clip_grad_norm(
            [p for p in self.model.parameters() if p.requires_grad], self.cfg.training.grad_clip))
        skipped = not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm))
        if skipped:
            logger.warning("Policy.train: non-finite loss or gradient norm; skipping the update")
        else:
            self.optimizer.step()
            self.lr_scheduler.step(full["input_ids"].shape[0])
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._count_skipped(skipped)
        return {**metrics, "grad_norm": grad_norm, "lr": lr, "num_valid_seqs": gvs,
                "num_valid_tokens": gvt, "skipped": skipped}

    def _count_skipped(self, skipped: bool) -> None:
        """Counts an update into the streak of skipped ones; stops the run at the limit."""
        self.skipped_streak = self.skipped_streak + 1 if skipped else 0
        limit = self.cfg.training.max_consecutive_skipped_steps
        if limit and self.skipped_streak >= limit:
            raise TrainingDiverged(
                f"training diverged: {self.skipped_streak} consecutive updates had a non-finite "
                "loss or gradient norm and were skipped; stopped without exporting. "
                "training.max_consecutive_skipped_steps sets the limit (null: never stop)")

    def _reduce_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Loss shares summed over micro-batches (done), pipeline (the last stage's, broadcast)
        and data-parallel ranks (cp ranks hold the same whole-row values)."""
        if self.pipeline is not None:
            obj = [{k: float(v) for k, v in sums.items()} if self.pipeline.is_last else None]
            dist.broadcast_object_list(obj, group=self.pipeline.pp_group,
                                       group_src=self.pipeline.last_rank)
            sums = {k: torch.tensor(v, dtype=torch.float64, device=self.device)
                    for k, v in obj[0].items()}
        keys = sorted(sums)
        vec = torch.stack([sums[k] for k in keys]) if keys else torch.zeros(0, dtype=torch.float64)
        self.dims.all_reduce_dp(vec)
        return {k: float(v) for k, v in zip(keys, vec)}

    # -- weights -------------------------------------------------------------------------------
    def state_dict_hf(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hub_name, full tensor)`` of every weight, LoRA merged in, in ``dtype`` (None: as
        held); the same on every rank. Collective: every rank must consume the whole iterator."""
        yield from hf_tensors(self.model, self.built.spec, dtype)

    def state_dict_full(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict in hybridtrain's names (full tensors, LoRA merged): what
        ``load_state_dict`` of a plain copy of the model takes (e.g. a rollout engine). Collective."""
        return full_state_dict(self.model, self.built.spec)

    def checkpointer(self, path: str):
        """The recipe's :class:`~hybridtrain.training.checkpoint.Checkpointer` of the run folder ``path``."""

        return build_checkpointer(self.built, path)

    def save_checkpoint(self, dir: str, export: bool = False, step: int | None = None,
                        extra: dict | None = None) -> str:
        """Writes ``dir/step_{N}`` (the finetune checkpoint format: model, optimizer, LR schedule,
        RNG; with ``export`` the HF export ``hf/``, or ``adapter/`` for LoRA) and ``dir/latest``;
        returns the step folder. ``N``: ``step`` (the caller's step count, e.g. GRPO's rollout
        steps), default the optimizer updates so far; the updates and the skipped-update streak
        are saved too, with the caller's JSON ``extra`` (see :meth:`load_checkpoint`). Collective."""
        extra = {**(extra or {}), "policy": {"updates": self.step,
                                             "skipped_streak": self.skipped_streak}}
        return self.checkpointer(dir).save(self.step if step is None else step, self.model,
                                           self.optimizer, self.lr_scheduler, extra=extra,
                                           export=export, final=export)

    def load_checkpoint(self, dir: str) -> dict[str, Any]:
        """Restores a checkpoint (a ``step_N`` folder, or a run folder: its ``latest``) written by
        :meth:`save_checkpoint` or ``hybridtrain finetune`` under any layout: weights, optimizer,
        LR schedule, this rank's global RNG states, the update count. Returns the trainer state
        (``step``: N, ``extra``: what the caller saved). Collective."""
        ck = self.checkpointer(dir)
        path = ck.resolve_resume(dir)
        if path is None:
            raise ValueError(f"load_checkpoint: {dir} holds no checkpoint")
        state = ck.load(path, self.model, self.optimizer, self.lr_scheduler)
        mine = (state.get("extra") or {}).get("policy", {})
        self.step = int(mine.get("updates", state.get("step", 0)))
        self.skipped_streak = int(mine.get("skipped_streak", 0))
        return state
