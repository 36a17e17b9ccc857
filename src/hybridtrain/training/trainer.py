"""The training loop.

One step = one global batch: every data-parallel rank runs ``grad_acc_steps`` micro-batches,
then the optimizer updates once. The loss is exact for any split of the global batch:

    loss = sum over all label tokens of the global batch of CE / (number of those tokens)

The label-token count of the global batch is known before any forward pass (summed over this
rank's micro-batches, then all-reduced over the data-parallel group), and each micro-batch's CE
*sum* is scaled by ``1 / count`` before backward. Gradients are therefore summed over ranks,
never averaged.

Validation (token-weighted CE over the whole validation set) runs before the first step, every
``val_every_steps`` and after the last step; an ``evaluator(model, step)`` adds its fields to
each validation record (answers generated and scored: ``training.evaluation``).

A step whose loss or gradient norm is not finite is skipped: gradients are dropped, the optimizer
and the LR scheduler do not move, ``skipped_steps`` grows, and training goes on. A global batch
without any label token is skipped the same way (it has no loss). The skip is decided on the
device and the loss, norm and skip are read back a step later, or at once at logging and
checkpoint steps (:mod:`hybridtrain.training.device_step`): the host never waits for a step.

A run that diverges stops: after ``max_consecutive_skipped_steps`` non-finite steps in a row
:meth:`Trainer.fit` raises :class:`TrainingDiverged` (no export is written). While such a streak
lasts no checkpoint is saved, so rotation never replaces the last checkpoint taken before it.

A run stops early on a signal or before ``training.max_time`` (``stop``, a
:class:`~hybridtrain.training.preemption.RunStop`): at the step boundary every rank agrees on,
it saves a checkpoint and :meth:`Trainer.fit` raises
:class:`~hybridtrain.training.preemption.Preempted`.

Layouts: the recipe lays the model out (``hybridtrain.distributed.parallel_plan.parallelize``, one
process included) before the optimizer is built; the resulting plan is what the trainer trains:
its model, device and autocast dtype, its :class:`TrainStep` (the model's own forward, or, under
pipeline parallelism, the plan's schedule step), its ``ParallelDims`` (the data-parallel group
of counts and loss reductions) and its gradient clipping over every mesh and stage.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridtrain.data.batch import IGNORE_INDEX, count_label_tokens, count_tokens, model_inputs
from hybridtrain.distributed.context_parallel import shard_batches, unshard_rows
from hybridtrain.distributed.parallel_plan import Plan
from hybridtrain.ops.aux_loss import AuxiliaryLoss
from hybridtrain.ops.expert_load import ExpertLoad
from hybridtrain.runfolder import TrainingStopped
from hybridtrain.training.accuracy import prediction_counts
from hybridtrain.training.checkpoint import Checkpointer
from hybridtrain.training.device_step import PendingStep, fused_step, supports_device_skip
from hybridtrain.training.flops import Throughput
from hybridtrain.training.metrics import MetricsLogger, peak_memory_gb
from hybridtrain.training.precision import autocast_context
from hybridtrain.training.preemption import Preempted, RunStop
from hybridtrain.training.settings import TrainerSettings, trainer_settings
from hybridtrain.training.step_scheduler import EvalBatchSampler, StepScheduler

logger = logging.getLogger(__name__)


class Window:
    """Steps since a point in time: their count, tokens and FLOPs (see ``Trainer._window_rates``)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.start, self.steps, self.tokens, self.flops = None, 0, 0, 0.0

    def begin(self, t: float) -> None:
        if self.start is None:
            self.start = t

    def add(self, tokens: int, flops: float) -> None:
        self.steps, self.tokens, self.flops = self.steps + 1, self.tokens + tokens, self.flops + flops

    def close(self, t: float) -> tuple[int, float, int, float]:
        """(steps, seconds, tokens, FLOPs) up to ``t``; the next window starts at ``t``."""
        out = (self.steps, t - self.start, self.tokens, self.flops)
        self.reset()
        self.start = t
        return out


class TrainingDiverged(TrainingStopped):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class TrainStep:
    """Forward and backward of this rank's micro-batches of one global batch; the one train
    step of every layout.

    ``__call__(model, micro_batches, num_label_tokens)`` back-propagates
    ``loss_sum(micro_batch) / num_label_tokens`` for each micro-batch (``num_label_tokens`` is
    the global count) and returns the detached fp32 sum over this rank's micro-batches, where
    ``loss_sum`` is ``model(input_ids, labels=labels, ...)``: the model's own forward with its
    summing training loss installed. ``eval_loss(model, batch)`` is that sum for one batch
    without gradients (validation), ``eval_predictions(model, batch)`` its predicted tokens.
    Under FSDP2 the gradient reduction runs only after the last micro-batch. ``pipeline``: a
    pipeline schedule step (``__call__`` and ``eval_loss`` of the same signatures, and
    ``eval_predictions(model, batch)``: the predicted tokens), which runs forward and backward
    of all micro-batches itself. Everything runs under
    :func:`~hybridtrain.training.precision.autocast_context` of ``autocast_dtype``.
    """

    def __init__(self, autocast_dtype: torch.dtype | None = None, pipeline: Any = None,
                 sharded: bool = False):
        self.autocast_dtype = autocast_dtype
        self.pipeline = pipeline
        self.sharded = sharded

    @classmethod
    def of(cls, plan: Plan) -> "TrainStep":
        """The step of ``plan``: its autocast dtype, its pipeline schedule step if any, and
        whether its model is sharded (``Plan.sharded``)."""
        return cls(autocast_dtype=plan.autocast_dtype, pipeline=plan.pipeline,
                   sharded=plan.sharded)

    @staticmethod
    def loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
        return model(batch["input_ids"], labels=batch["labels"], **model_inputs(batch))

    def __call__(self, model: nn.Module, micro_batches: Sequence[dict],
                 num_label_tokens: int) -> torch.Tensor:
        if self.pipeline is not None:
            with autocast_context(self.autocast_dtype, micro_batches[0]["input_ids"].device):
                return self.pipeline(model, micro_batches, num_label_tokens)
        total = None
        for i, mb in enumerate(micro_batches):
            if self.sharded:  # FSDP2: reduce the gradients once per step
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            with autocast_context(self.autocast_dtype, mb["input_ids"].device):
                ce = self.loss_sum(model, mb)
            (ce / num_label_tokens).backward()
            ce = ce.detach().float()
            total = ce if total is None else total + ce
        return total

    @torch.no_grad()
    def eval_predictions(self, model: nn.Module, batch: dict) -> torch.Tensor | None:
        """The predicted tokens ``[rows, L]`` (argmax of the logits) of a validation batch;
        None on a rank that predicts none (an encoder's own ranks); a pipeline's on every pp
        rank."""
        with autocast_context(self.autocast_dtype, batch["input_ids"].device):
            if self.pipeline is not None:
                return self.pipeline.eval_predictions(model, batch)
            return model(batch["input_ids"], **model_inputs(batch)).argmax(-1)

    @torch.no_grad()
    def eval_loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        with autocast_context(self.autocast_dtype, batch["input_ids"].device):
            if self.pipeline is not None:
                return self.pipeline.eval_loss(model, batch)
            return self.loss_sum(model, batch)


# -- the trainer -----------------------------------------------------------------------------
def _to_device(batch: dict, device: torch.device) -> dict:
    nb = device.type == "cuda"
    return {k: v.to(device, non_blocking=nb) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


@dataclass(frozen=True)
class TrainData:
    """What the loop reads: the ``train`` dataset, the ``val`` dataset (None: no validation),
    and ``make_loader(dataset, batch_sampler)``, an iterable of collated batches (the recipe
    wraps ``torch.utils.data.DataLoader`` with the dataset's collator)."""

    train: Any
    make_loader: Callable[[Any, Any], Any]
    val: Any = None


class Trainer:
    """Runs the loop of :mod:`hybridtrain.training` (see module docstring).

    ``plan``: what this rank trains (:func:`~hybridtrain.distributed.parallel_plan.parallelize`'s,
    :meth:`ParallelPlan.single` for one process, or a heterogeneous layout's); its step is ``TrainStep.of(plan)`` (the
    ``train_step`` attribute; a test may replace it). ``data``: the datasets and their loader.
    ``settings``: the recipe's loop values (:func:`~hybridtrain.training.settings.trainer_settings`;
    default: the recipe's defaults). ``checkpointer`` (None: no checkpoints), ``metrics`` (None: no
    files), ``throughput`` (None: no ``tflops_per_device`` / ``mfu``), ``evaluator(model,
    step)`` (fields added to each validation record), ``stop`` (default: never stops early),
    ``aux_loss`` (the model's extra objectives, :mod:`hybridtrain.ops.aux_loss`: their
    normalisers join the step's counts, their values the step's record), ``expert_load`` (the
    MoE routers' load, :mod:`hybridtrain.ops.expert_load`: its metrics join the record, its
    bias update follows each optimizer step), ``after_update(model)`` (run after each optimizer
    step, e.g. float8 scales precomputed for FSDP2's float8 all-gather).
    """

    def __init__(
        self,
        plan: Plan,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler,
        step_scheduler: StepScheduler,
        data: TrainData,
        settings: TrainerSettings | None = None,
        *,
        checkpointer: Checkpointer | None = None,
        metrics: MetricsLogger | None = None,
        throughput: Throughput | None = None,
        evaluator: Callable[[nn.Module, int], dict] | None = None,
        stop: RunStop | None = None,
        aux_loss: AuxiliaryLoss | None = None,
        expert_load: ExpertLoad | None = None,
        after_update: Callable[[nn.Module], None] | None = None,
    ):
        self.plan = plan
        self.model = plan.model
        self.device = torch.device(plan.device)
        self.dims = plan.dims
        self.train_step = TrainStep.of(plan)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.sched = step_scheduler
        self.data = data
        self.settings = settings or trainer_settings()  # default: the recipe's defaults
        self.checkpointer = checkpointer
        self.metrics = metrics
        self.throughput = throughput
        self.val_micro_batch_size = (self.settings.training.val_micro_batch_size
                                     or step_scheduler.micro_batch_size)
        self.evaluator = evaluator
        self.stop = stop or RunStop()  # default: never stops early
        # the model's extra objectives (e.g. multi-token prediction), logged beside `loss`
        self.aux_loss = aux_loss
        # the MoE routers' load per step (moe_max_load, ...) and their correction-bias update
        self.expert_load = expert_load
        self.after_update = after_update
        self._saved_step: int | None = None  # step of this process's latest checkpoint
        self._nonfinite_streak = 0  # consecutive steps skipped for a non-finite loss / norm
        self._diverged = False  # the streak reached max_consecutive_skipped_steps
        self._pending: PendingStep | None = None  # the step queued but not yet read back
        # a logging step's time and rates are those of its window of steps, on every device:
        # the host may run ahead of CUDA, and the window holds the loader's and the loop's time
        self._window = Window()
        self.history: list[dict] = []  # every step's record (also the non-logged ones)
        self.val_history: list[dict] = []

    # -- one step ----------------------------------------------------------------------------
    def _params(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def train_one_step(self, micro_batches: list[dict]) -> dict[str, Any]:
        """Runs one global batch: forward/backward, clip, update (or skip). Returns its record,
        settled (loss, grad norm and skip read back; on CUDA the step finished)."""
        rec = self.step(micro_batches)
        self.settle()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # this one-step API is timed by its callers
        return rec

    def step(self, micro_batches: list[dict]) -> dict[str, Any]:
        """One global batch queued without waiting on the device (see :mod:`.device_step`):
        the update is skipped on the device where the loss or norm is not finite, and the
        record's ``loss`` / ``grad_norm`` / ``skipped_steps`` are filled in when the step is
        settled (by the next step, or :meth:`settle`). Settling the previous step here is the
        one read per step, of a flag the device finished a step ago."""
        t0 = time.perf_counter()
        self._window.begin(t0)
        flops = self.throughput.flops(micro_batches) if self.throughput is not None else 0.0
        whole_rows = micro_batches
        if self.dims.cp > 1:  # this rank's slice of every row; counts and sums over dp x cp
            micro_batches = shard_batches(micro_batches, self.dims.cp_rank, self.dims.cp)
            flops /= self.dims.cp
        # counted on the loader's host tensors, before they move: no device read
        aux = self.aux_loss
        num_label_tokens, num_tokens, flops, aux_counts = self._global_counts(micro_batches, whole_rows, flops)
        micro_batches = [_to_device(mb, self.device) for mb in micro_batches]
        aux_values = {} if aux is None else aux.record(torch.zeros(aux.num_terms), torch.zeros(aux.num_terms))
        self.model.train()
        rec = {"step": self.sched.step + 1, "num_label_tokens": num_label_tokens,
               "num_tokens": num_tokens}
        on_device = self._skip_on_device
        if num_label_tokens == 0:
            logger.warning("step %d: the global batch has no label tokens; skipping it",
                           self.sched.step + 1)
            pending = PendingStep.of(rec, torch.full((2,), math.nan, dtype=torch.float64))
            self.settle()
        else:
            if aux is not None:
                aux.begin_step(aux_counts)
            if self.expert_load is not None:
                self.expert_load.begin_step(self.device)
            ce = self.train_step(self.model, micro_batches, num_label_tokens)
            ce = ce.to(self.device, torch.float64).reshape(1)
            if aux is not None:
                ce = torch.cat([ce, self._pp_sum(aux.step_sums(self.device))])
                aux.end_step()
            ce = self.dims.all_reduce_dp_cp(ce)
            loss = ce[0] / num_label_tokens
            if aux is not None:
                aux_values = aux.record(ce[1:], aux_counts)
            if self.expert_load is not None:
                load_table = self._sum_expert_load(self.expert_load.end_step())
                aux_values.update(self.expert_load.record(load_table))
            grad_norm = self.plan.clip_grad_norm(self._params(), self.settings.training.grad_clip)
            pending = PendingStep.of(rec, torch.stack([loss, grad_norm.to(loss)]))
            self.settle()  # the previous step (its flag is a step old): the LR of this update
            if self.optimizer is not None:  # None: nothing trainable on this rank
                if on_device:
                    fused_step(self.optimizer, pending.nonfinite)
                elif not pending.skipped:  # read now: this step waits on the device
                    self.optimizer.step()
                if self.after_update is not None and (on_device or not pending.skipped):
                    self.after_update(self.model)  # (a step skipped on the device: same weights)
            if self.expert_load is not None and not pending.skipped:  # (read: on_device is False)
                self.expert_load.update_biases(load_table)
        lr = (self.lr_scheduler.get_lr() if self.lr_scheduler else
              self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else None)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        epoch = self.sched.epoch
        self.sched.advance()  # skipped_steps: counted when the step is settled
        dt = time.perf_counter() - t0
        world = self.dims.world_size
        tps = num_tokens / dt if dt > 0 else None
        tflops = mfu = None
        if self.throughput is not None and dt > 0:
            tflops, mfu = self.throughput.rates(flops, dt, world)
        rec.update({
            "lr": lr, "tps": tps,
            "tps_per_device": tps / world if tps is not None else None,
            "tflops_per_device": tflops, "mfu": mfu,
            "mem_gb": peak_memory_gb(self.device),
            "consumed_samples": self.sched.consumed_samples,
            "epoch": epoch, "step_time_s": dt, **aux_values,
        })
        self._pending = pending
        self._window.add(num_tokens, flops)
        if num_label_tokens == 0 or not on_device:
            self.settle()  # known on the host already
        return rec

    def _global_counts(self, micro_batches: list[dict], whole_rows: list[dict], flops: float
                       ) -> tuple[int, int, float, torch.Tensor | None]:
        """(label tokens, tokens, FLOPs, the extra objectives' counts or None) of the global
        batch, from this rank's host tensors summed over the data(-and-context)-parallel ranks
        (``whole_rows``: the micro-batches before context parallelism sliced them).
        No rank to sum over: no device involved; else one all-reduce, read back (the count scales
        this step's loss)."""
        counts = [sum(count_label_tokens(mb) for mb in micro_batches),
                  sum(count_tokens(mb) for mb in micro_batches), flops]
        aux = None if self.aux_loss is None else self._aux_counts(self.aux_loss, whole_rows).to(torch.float64)
        if not self.dims.sums_over_ranks:
            return int(counts[0]), int(counts[1]), float(counts[2]), aux
        t = torch.tensor(counts, dtype=torch.float64, device=self.device)
        if aux is not None:  # its terms' normalisers, in the same all-reduce
            t = torch.cat([t, aux.to(t)])
        self.dims.all_reduce_dp_cp(t)  # global batch: all data(-and-context)-parallel ranks
        n_label, n_tok, flops = t[:3].tolist()
        return int(n_label), int(n_tok), float(flops), (t[3:] if aux is not None else None)

    @property
    def _skip_on_device(self) -> bool:
        """Whether the update is skipped on the device flag (else the flag is read first): the
        fused AdamW, and no extra objectives or expert-load updates (their records and the
        routers' bias update read the step's values)."""
        if self.aux_loss is not None or self.expert_load is not None:
            return False
        return self.optimizer is None or supports_device_skip(self.optimizer)

    def settle(self) -> None:
        """Reads back the queued step (if any): fills its record, counts a skip (the LR
        schedule does not advance) or advances the LR schedule, and counts the non-finite
        streak (:class:`TrainingDiverged` when it reaches the limit)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        rec = pending.read()
        skipped = pending.skipped
        if skipped:
            self.sched.skipped_steps += 1
            if rec["num_label_tokens"]:
                logger.warning("step %d: non-finite %s; skipping the update (lr stays %.3g)",
                               rec["step"], "loss" if not math.isfinite(rec["loss"])
                               else "gradient norm", rec["lr"] if "lr" in rec else float("nan"))
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(self.sched.global_batch_size)
        rec["skipped_steps"] = self.sched.skipped_steps
        self._diverged = self._count_nonfinite(rec)
        if self.metrics is not None:
            self.metrics.progress(rec["step"], rec["loss"], rec.get("lr"), rec.get("tps"),
                                  extra=self._progress_extra(rec))

    def _aux_counts(self, aux: AuxiliaryLoss, whole_rows: list[dict]) -> torch.Tensor:
        """This rank's part of the extra objectives' normalisers: counted over whole rows (a
        term may read positions of the next context-parallel slice, e.g. tokens ahead), once
        per context-parallel group (by its first rank)."""
        counts = sum(aux.counts(mb) for mb in whole_rows)
        return counts.zero_() if self.dims.cp > 1 and self.dims.cp_rank else counts

    def _sum_expert_load(self, table: torch.Tensor) -> torch.Tensor:
        """The step's token counts per expert summed over the ranks holding other tokens
        (data, expert, context parallel) and other layers (pipeline stages)."""
        self.dims.all_reduce_dp_cp(table)
        return self._pp_sum(table)

    def _pp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the pipeline stages' ranks (in place; e.g. the extra objectives'
        sums, which the stage computing them holds)."""
        if self.dims.pp > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.dims.group("pp"))
        return t

    def _progress_extra(self, rec: dict) -> dict[str, float | None]:
        """The extra objectives' summary values for the progress line."""
        if self.aux_loss is None:
            return {}
        return {n: rec.get(n) for n in self.aux_loss.summary_names}

    # -- validation --------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, Any] | None:
        """Token-weighted CE over the validation set (all ranks); returns the record."""
        if self.data.val is None:
            return None
        t0 = time.perf_counter()
        sampler = EvalBatchSampler(len(self.data.val), self.val_micro_batch_size,
                                   self.dims.dp_rank, self.dims.dp)
        was_training = self.model.training
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # ce, label tokens, rows
        acc = torch.zeros(4, dtype=torch.float64, device=self.device)  # see answer_counts
        for i, batch in enumerate(self.data.make_loader(self.data.val, sampler)):
            if self.settings.training.max_val_steps and i >= self.settings.training.max_val_steps:
                break
            batch = _to_device(batch, self.device)
            n_real = sampler.num_real[i]
            if n_real < batch["labels"].shape[0]:  # filler rows (uneven split over ranks)
                batch["labels"] = batch["labels"].clone()
                batch["labels"][n_real:] = IGNORE_INDEX
            whole = batch
            if self.dims.cp > 1:
                batch = shard_batches([batch], self.dims.cp_rank, self.dims.cp)[0]
                n_real = n_real if self.dims.cp_rank == 0 else 0
            ce = self.train_step.eval_loss(self.model, batch)
            sums += torch.tensor([float(ce), count_label_tokens(batch), n_real],
                                 dtype=torch.float64, device=self.device)
            if self.settings.training.val_accuracy:
                counts = self._answer_counts(batch, whole)
                if counts is not None:
                    acc += counts.to(self.device)
        self.dims.all_reduce_dp_cp(sums)
        self.model.train(was_training)
        val_loss = float(sums[0] / sums[1]) if sums[1] > 0 else None
        rec = {
            "step": self.sched.step,
            "val_loss": val_loss,
            "val_ppl": math.exp(val_loss) if val_loss is not None and val_loss < 50 else None,
            "num_label_tokens": int(sums[1]),
            "num_samples": int(sums[2]),
            **self._accuracy(acc),
            "time_s": time.perf_counter() - t0,
        }
        if self.evaluator is not None:  # answers generated for validation examples, scored
            rec.update(self.evaluator(self.model, self.sched.step))
        return rec

    def _answer_counts(self, batch: dict, whole: dict) -> torch.Tensor | None:
        """:func:`~hybridtrain.training.accuracy.answer_counts` of validation batch ``whole``
        (``batch``: this rank's context-parallel slice of it) from this rank, None where it adds
        nothing: under context parallelism the slices' predictions are joined into whole rows
        (an answer may span slices) and counted on the first slice's rank."""
        pred = self.train_step.eval_predictions(self.model, batch)
        if pred is None:
            return None
        if self.dims.cp > 1:
            pred = unshard_rows(pred, self.dims.group("cp"))[:, :whole["labels"].shape[1]]
            if self.dims.cp_rank:
                return None
        return prediction_counts(pred, whole)

    def _accuracy(self, acc: torch.Tensor) -> dict[str, float | None]:
        """``answer_accuracy`` / ``token_accuracy`` of the summed counts (with ``val_accuracy``)."""
        if not self.settings.training.val_accuracy:
            return {}
        self.dims.all_reduce_dp_cp(acc)
        return {"answer_accuracy": float(acc[0] / acc[1]) if acc[1] else None,
                "token_accuracy": float(acc[2] / acc[3]) if acc[3] else None}

    def _validate_and_log(self) -> None:
        val = self.validate()
        self.val_history.append(val)
        if self.metrics is not None:
            self.metrics.log_val(val)

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, final: bool = False) -> str | None:
        if self.checkpointer is None:
            return None
        export = self.checkpointer.save_hf or (final and self.settings.checkpoint.save_hf_at_end)
        return self.checkpointer.save(
            self.sched.step, self.model, self.optimizer, self.lr_scheduler, self.sched,
            export=export, final=final)

    def _save(self, final: bool = False) -> str | None:
        """:meth:`save_checkpoint`, timed by ``stop`` (a signal meanwhile is only noted)."""
        with self.stop.saving():
            path = self.save_checkpoint(final=final)
        self._saved_step = self.sched.step
        return path

    def _stop_early(self, reason: str, last_ckpt: str | None) -> None:
        """Saves (unless this step is saved already) and raises :class:`Preempted`."""
        step = self.sched.step
        if self.checkpointer is None or not self.settings.checkpoint.enabled:
            where = "checkpoints are off (checkpoint.enabled: false): nothing was saved"
        elif self._nonfinite_streak:
            where = (f"no checkpoint written (the last {self._nonfinite_streak} steps were "
                     f"non-finite); latest is {self.checkpointer.latest()}")
        else:
            path = last_ckpt if self._saved_step == step else self._save()
            where = f"saved {path}; resume with --checkpoint.resume=auto"
        if self.metrics is not None:
            self.metrics.close()
        raise Preempted(f"{reason}: stopped after step {step} of {self.sched.max_steps}; "
                        f"{where}")

    def resume(self, path: str) -> None:
        assert self.checkpointer is not None
        self.checkpointer.load(path, self.model, self.optimizer, self.lr_scheduler, self.sched)

    # -- divergence --------------------------------------------------------------------------
    def _window_rates(self, rec: dict) -> None:
        """A logging step's ``step_time_s`` and rates over the steps since the last logging step
        (or validation, or save), timed to the end of the device's work (CUDA: the host does not
        wait for a step, so one step's own time is the host's), with the loader's time of every
        step of the window but the first and the loop's own work (logging) between them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        steps, seconds, tokens, flops = self._window.close(time.perf_counter())
        if seconds <= 0:
            return
        world = self.dims.world_size
        rec.update(step_time_s=seconds / steps, tps=tokens / seconds,
                   tps_per_device=tokens / seconds / world)
        if self.throughput is not None:
            rec["tflops_per_device"], rec["mfu"] = self.throughput.rates(flops, seconds, world)

    def _streak_may_end_run(self) -> bool:
        """Whether the queued step's flag may reach ``max_consecutive_skipped_steps`` (then it
        is read at once, so that the run stops at that step)."""
        limit = self.settings.training.max_consecutive_skipped_steps
        return bool(limit) and self._nonfinite_streak + 1 >= limit

    def _count_nonfinite(self, rec: dict) -> bool:
        """Counts step ``rec`` into the non-finite streak; True when the streak hits the limit."""
        nonfinite = rec["num_label_tokens"] > 0 and not (
            math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"]))
        self._nonfinite_streak = self._nonfinite_streak + 1 if nonfinite else 0
        limit = self.settings.training.max_consecutive_skipped_steps
        return bool(limit) and self._nonfinite_streak >= limit

    def _stop_diverged(self) -> None:
        """Raises :class:`TrainingDiverged`. The checkpoint taken just before the streak holds
        the update that made it diverge: ``latest`` goes back to an older one when there is."""
        if self.metrics is not None:
            self.metrics.close()
        n, step = self._nonfinite_streak, self.sched.step
        first = step - n + 1
        where = "No checkpoint was written before the divergence"
        if self.checkpointer is not None and self.checkpointer.steps():
            older = [s for s in self.checkpointer.steps() if s < first - 1]
            suspect = [s for s in self.checkpointer.steps() if s >= first - 1]
            if older:
                path = self.checkpointer.set_latest(older[-1])
                where = (f"`latest` now names {path}, the newest checkpoint before the "
                         f"update that diverged" + (f" (step_{suspect[-1]} may hold the "
                                                    f"diverged weights)" if suspect else ""))
            else:
                where = (f"The only checkpoint, {self.checkpointer.latest()}, was taken right "
                         f"before the non-finite steps and may hold the diverged weights")
            where += ("; resume with --checkpoint.resume=auto after lowering optimizer.lr or "
                      "tightening training.grad_clip")
        raise TrainingDiverged(
            f"training diverged: {n} consecutive steps ({first}..{step}) had a non-finite loss "
            f"or gradient norm and were skipped; stopped without exporting. {where}. "
            "training.max_consecutive_skipped_steps sets the limit (null: never stop)")

    # -- the loop ----------------------------------------------------------------------------
    def _train_loop(self, batches) -> str | None:
        """Steps until ``max_steps`` (or an early stop); returns the last checkpoint saved."""
        import gc

        sched, last_ckpt, settings = self.sched, None, self.settings
        saving = self.checkpointer is not None and settings.checkpoint.enabled
        while not sched.done:
            micro_batches = next(batches)
            rec = self.step(micro_batches)
            self.history.append(rec)
            if sched.is_log_step or sched.is_ckpt_step or self._streak_may_end_run():
                self.settle()  # read back at logging steps (and where the values decide)
            if sched.is_log_step:
                self._window_rates(rec)
            if self.metrics is not None and (sched.is_log_step or self._diverged):
                self.metrics.log_train(rec)
            if self._diverged:
                self._stop_diverged()
            gc_every = settings.training.gc_every_steps
            if gc_every and sched.step % gc_every == 0:
                gc.collect()
            if self.data.val is not None and sched.is_val_step:
                self._validate_and_log()
                self._window.reset()  # (not a training step's time)
            if saving and sched.is_ckpt_step and (self._nonfinite_streak == 0 or sched.done):
                last_ckpt = self._save(final=sched.done)
                self._window.reset()
            if sched.done:
                break
            if saving and self.stop.needs_timed_save():
                self.settle()
                last_ckpt = self._save()  # training.max_time: how long a save takes
            reason = self.stop.requested()
            if reason is not None:
                self.settle()
                self._stop_early(reason, last_ckpt)
        return last_ckpt

    def _final_export(self, last_ckpt: str | None) -> str | None:
        """The export of the finished run (``save_hf_at_end``) and its ``final`` link; returns
        the folder holding it."""
        if not (self.settings.checkpoint.save_hf_at_end and self.checkpointer is not None):
            return None
        if last_ckpt is None and self.settings.checkpoint.enabled:
            last_ckpt = self.checkpointer.latest()  # a finished run resumed: nothing to do
        if last_ckpt is not None:
            export_dir = last_ckpt
        else:  # checkpoints off: the export goes into the run folder itself
            self.checkpointer.export(self.model, self.checkpointer.dir, final=True)
            export_dir = self.checkpointer.dir
        self.checkpointer.mark_final(export_dir)
        return export_dir

    def fit(self) -> dict[str, Any]:
        """Trains until ``max_steps``; returns a summary (paths, first/last loss, times)."""
        sched = self.sched
        t_start = time.perf_counter()
        if self.metrics is not None:
            self.metrics.open(sched.step, sched.max_steps)
        if self.data.val is not None and sched.step == 0:  # the starting point of the curve
            self._validate_and_log()
        batches = sched.train_batches(
            lambda sampler: self.data.make_loader(self.data.train, sampler),
            len(self.data.train), dp_rank=self.dims.dp_rank)
        with self.stop.catching():  # until the final export is written (a signal: noted)
            last_ckpt = self._train_loop(batches)
            export_dir = self._final_export(last_ckpt)
        if self.stop.received:
            logger.warning("%s received after the last step: the run finished",
                           ", ".join(sorted({signal.Signals(x).name for x in self.stop.received})))
        plot = self.metrics.close(export_dir=export_dir) if self.metrics is not None else None
        losses = [r["loss"] for r in self.history if math.isfinite(r["loss"])]
        return {
            "steps": sched.step,
            "skipped_steps": sched.skipped_steps,
            "consumed_samples": sched.consumed_samples,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "last_val_loss": self.val_history[-1]["val_loss"] if self.val_history else None,
            "last_eval": {k: self.val_history[-1][k] for k in ("exact_match", "f1")
                          if self.val_history and k in self.val_history[-1]},
            "wall_time_s": time.perf_counter() - t_start,
            "checkpoint": last_ckpt,
            "export_dir": export_dir,
            "loss_png": plot,
        }
