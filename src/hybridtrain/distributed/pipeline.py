"""Pipeline parallelism on ``torch.distributed.pipelining``: the train step. Schedules and the
stage split are in :mod:`hybridtrain.distributed.pipeline_layout`.

* **Train step** (:class:`PipelineTrainStep`): one ``schedule.step`` per global batch; the
  trainer's micro-batches of the step become the pipeline's micro-batches (or, with
  ``distributed.pp_microbatch_size``, the step's rows are re-split into micro-batches of that
  many rows). The last stage
  computes each micro-batch's cross-entropy *sum*; the schedule back-propagates
  ``sum / label tokens of the global batch`` (``scale_grads=False``), so gradients equal the
  single-process ones. The last stage keeps no outputs (``return_outputs=False``); the loss
  sum is then all-reduced over the ``pp`` group so every rank logs it.

Every stage receives ``position_ids`` (document boundaries of packed rows; derived from
``cu_seqlens`` when only those are given) and ``labels`` as keyword inputs, split into
micro-batches along the batch dimension like ``input_ids`` (with a model spec's
``pipeline_row_inputs``, also the model's further per-row inputs, e.g. each row's images for
an encoder on the first stage). All micro-batches of a step share
one sequence length: shorter ones are right-padded (labels ``-100``, positions continuing, so
nothing real changes); the pipeline keeps one schedule per sequence length it has seen.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridtrain.data.batch import IGNORE_INDEX
from hybridtrain.data.micro_batches import merge_micro_batches
from hybridtrain.distributed.pipeline_layout import build_schedule, resolve_schedule, stage_rank

logger = logging.getLogger(__name__)

__all__ = ["PipelineTrainStep"]


class _AsVector(nn.Module):
    """The last stage's scalar CE sum as a 1-element vector (forward-only schedules merge the
    micro-batch outputs by concatenation)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs).reshape(1)


def _grads_in_param_layout(stages: Sequence[nn.Module]) -> None:
    """Give every plain gradient its parameter's strides. The zero-bubble schedules' weight pass
    sets gradients as autograd returns them (e.g. a Mamba conv weight's transposed), not in the
    parameter's layout as autograd's own accumulation does, and fused optimizers read a
    gradient by its parameter's strides (torch's fused CPU AdamW updates the wrong elements)."""
    for stage in stages:
        for p in stage.parameters():
            g = p.grad
            if g is not None and type(g) is torch.Tensor and g.stride() != p.stride():
                p.grad = torch.empty_strided(p.shape, p.stride(), dtype=g.dtype,
                                             device=g.device).copy_(g)


# -- the train step -----------------------------------------------------------------------------
class PipelineTrainStep:
    """Forward+backward of one global batch through the pipeline (see module docstring).

    ``stages``: this rank's stage modules, each ``forward(x, position_ids=, labels=)`` returning
    the hidden states ``[rows, L, hidden_size]`` in ``hidden_dtype`` (or, on the last stage, the
    fp32 CE *sum*); ``stage_ids``: their indices. ``row_inputs(micro_batch) -> {name: tensor}``:
    further keyword inputs of every stage (used by the first), each with one entry per row, so
    that the schedule splits them into micro-batches with the rows (a model spec's
    ``pipeline_row_inputs``, e.g. a row's images). ``shape_group``: the ranks that agree on
    the step's sequence length (the layout's ranks; None: all).
    The trainer's ``TrainStep(pipeline=...)`` calls it under its autocast context:
    ``__call__(model, micro_batches, num_label_tokens)`` returns the CE sum of this data-parallel
    rank's batch (on every pp rank), ``eval_loss(model, batch)`` is the forward-only CE sum for
    validation and ``eval_predictions(model, batch)`` its predicted tokens (accuracy).
    """

    MAX_CACHED_SCHEDULES = 16

    def __init__(
        self,
        stages: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        pp_group,
        device: torch.device,
        hidden_size: int,
        hidden_dtype: torch.dtype,
        schedule: str = "1f1b",
        microbatch_size: int | None = None,
        pad_multiple: int = 1,
        shape_group=None,
        row_inputs=None,
    ):
        self.shape_group = shape_group  # the ranks that run one shape (None: all)
        self.spec = resolve_schedule(schedule)
        self.stages = list(stages)
        self.stage_ids = list(stage_ids)
        self.num_stages = num_stages
        self.pp_group = pp_group
        self.pp = dist.get_world_size(pp_group)
        self.device = torch.device(device)
        self.hidden_size = hidden_size
        self.hidden_dtype = hidden_dtype
        self.microbatch_size = microbatch_size
        self.pad_multiple = max(1, int(pad_multiple))
        self.row_inputs = row_inputs
        if self.spec.multi != (len(self.stages) > 1):
            raise ValueError(
                f"distributed.pp_schedule={self.spec.name!r} runs "
                f"{'several stages' if self.spec.multi else 'one stage'} per rank, but this rank "
                f"has {len(self.stages)}; set pp_stages_per_rank accordingly"
            )
        self._schedules: dict[tuple, Any] = {}
        self._num_label_tokens = 1.0
        self._ce_sums: list[torch.Tensor] = []

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self._ce_sums.append(output.detach().float().reshape(()))
        return output / self._num_label_tokens

    def _n_microbatches(self, batch_size: int, requested: int) -> int:
        if self.microbatch_size:
            if batch_size % self.microbatch_size:
                raise ValueError(
                    f"pipeline: the local batch of {batch_size} samples (micro_batch_size × "
                    f"gradient accumulation) is not divisible by distributed.pp_microbatch_size="
                    f"{self.microbatch_size}"
                )
            return batch_size // self.microbatch_size
        return requested

    def _stage_meta(self, sid: int, rows: int, length: int):
        """Static shapes of a stage's input and output (no run-time shape inference, which
        would run an extra forward/backward and leave gradients behind)."""
        meta = torch.device("meta")
        # activations carry gradients in both directions (requires_grad is part of the meta)
        hidden = torch.empty(rows, length, self.hidden_size, dtype=self.hidden_dtype,
                             device=meta).requires_grad_(True)
        if sid == 0:
            inp = torch.empty(rows, length, dtype=torch.long, device=meta)
        else:
            inp = hidden
        out = torch.empty((), dtype=torch.float32, device=meta) if sid == self.num_stages - 1 else hidden
        return inp, out

    def _schedule(self, n_micro: int, rows: int, length: int, train: bool):
        key = (n_micro, rows, length, train)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            stages = []
            for m, sid in zip(self.stages, self.stage_ids):
                inp, out = self._stage_meta(sid, rows, length)
                if not train:  # forward only: the last stage's CE sums are merged outputs
                    inp, out = inp.detach(), out.detach()
                    if sid == self.num_stages - 1:
                        m, out = _AsVector(m), out.reshape(1)
                stages.append(PipelineStage(m, sid, self.num_stages, self.device, input_args=inp,
                                            output_args=out, group=self.pp_group))
            sched = build_schedule(self.spec, stages, n_micro, self._loss if train else None)
            if len(self._schedules) >= self.MAX_CACHED_SCHEDULES:  # e.g. unpacked batches of
                self._schedules.pop(next(iter(self._schedules)))  # many lengths: drop the oldest
            self._schedules[key] = sched
        return self._schedules[key]

    def _global_length(self, length: int) -> int:
        """Every rank must run the same shapes (FSDP/EP collectives inside stages)."""
        m = self.pad_multiple
        length = -(-length // m) * m
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([length], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.shape_group)
            length = int(t)
        return length

    def _eval_rows(self, batch: dict) -> dict:
        """Validation batches may be small: add label-free rows until every stage gets work
        (at least ``num_stages`` micro-batches, a multiple of ``pp``)."""
        mbs = self.microbatch_size or 1
        n = -(-batch["input_ids"].shape[0] // mbs)
        need = max(n, self.num_stages)
        need = -(-need // self.pp) * self.pp
        extra = need * mbs - batch["input_ids"].shape[0]
        if extra <= 0:
            return batch
        out = {}
        for k, v in batch.items():
            fill = IGNORE_INDEX if k == "labels" else 0
            if k == "position_ids":
                pad = torch.arange(v.shape[1], device=v.device).expand(extra, -1)
            else:
                pad = v.new_full((extra,) + tuple(v.shape[1:]), fill)
            out[k] = torch.cat([v, pad])
        return out

    def _run(self, micro_batches: Sequence[dict], num_label_tokens: float, train: bool):
        length = self._global_length(max(mb["input_ids"].shape[1] for mb in micro_batches))
        batch = merge_micro_batches(micro_batches, length, self.row_inputs)
        if not train:
            batch = self._eval_rows(batch)
        n_rows = batch["input_ids"].shape[0]
        if train:
            n_micro = self._n_microbatches(n_rows, len(micro_batches))
        else:  # _eval_rows made the rows a multiple of the micro-batch size
            n_micro = n_rows // (self.microbatch_size or 1)
        if n_rows % n_micro:
            raise ValueError(
                f"pipeline: {n_rows} rows do not split into {n_micro} equal micro-batches; "
                "use equal micro-batch sizes (or set distributed.pp_microbatch_size)"
            )
        sched = self._schedule(n_micro, n_rows // n_micro, length, train)
        self._num_label_tokens = float(num_label_tokens)
        self._ce_sums = []
        first = 0 in self.stage_ids
        args = (batch["input_ids"],) if first else ()
        kwargs = {k: v for k, v in batch.items() if k != "input_ids"}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if not train and self.spec.style == "v":
            # the V schedules have no forward-only mode: walk the stages micro-batch by micro-batch
            total = total + self._forward_only(batch, n_micro, *args)
            dist.all_reduce(total, group=self.pp_group)
            return total
        if train:
            sched.step(*args, target=batch["labels"], return_outputs=False, **kwargs)
            if self.spec.split_backward:
                _grads_in_param_layout(self.stages)
            for s in self._ce_sums:
                total = total + s.to(self.device)
        else:
            out = sched.step(*args, **kwargs)
            if out is not None:  # the rank of the last stage: one CE sum per micro-batch
                total = total + out.float().sum().to(self.device)
        self._ce_sums = []
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank holds it
        return total

    def _forward_only(self, batch: dict, n_micro: int, *args) -> torch.Tensor:
        """This rank's CE sum (the last stage's) of :meth:`forward_outputs`."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for out in self.forward_outputs(batch, n_micro):
            total = total + out.float()
        return total

    def forward_outputs(self, batch: dict, n_micro: int) -> list[torch.Tensor]:
        """Forward-only pass without a schedule: micro-batch after micro-batch, every rank walks
        the stages in order, running its own and sending/receiving at rank boundaries (one
        global order, so no deadlock). Returns the last stage's output of every micro-batch on
        the rank that runs it, ``[]`` on the others."""
        me = dist.get_rank(self.pp_group)
        owner = [stage_rank(s, self.pp, self.spec.style) for s in range(self.num_stages)]
        module = dict(zip(self.stage_ids, self.stages))
        rows = batch["input_ids"].shape[0] // n_micro
        outputs = []
        for m in range(n_micro):
            sl = slice(m * rows, (m + 1) * rows)
            kwargs = {k: v[sl] for k, v in batch.items() if k != "input_ids"}
            x = None
            for s in range(self.num_stages):
                if owner[s] != me:
                    continue
                if s == 0:
                    x = batch["input_ids"][sl]
                elif owner[s - 1] != me:
                    x = torch.empty(rows, batch["input_ids"].shape[1], self.hidden_size,
                                    dtype=self.hidden_dtype, device=self.device)
                    dist.recv(x, group=self.pp_group, group_src=owner[s - 1])
                out = module[s](x, **kwargs)
                if s == self.num_stages - 1:
                    outputs.append(out)
                    continue
                x = out
                if owner[s + 1] != me:
                    dist.send(x.contiguous(), group=self.pp_group, group_dst=owner[s + 1])
        return outputs

    def __call__(self, model: nn.Module, micro_batches: Sequence[dict], num_label_tokens: int):
        return self._run(micro_batches, num_label_tokens, train=True)

    def eval_loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """Forward-only CE sum of one batch (validation); equal on every pp rank."""
        with torch.no_grad():
            return self._run([batch], 1.0, train=False)

    @property
    def last_rank(self) -> int:
        """The pp rank of the last stage."""
        return stage_rank(self.num_stages - 1, self.pp, self.spec.style)

    @torch.no_grad()
    def eval_predictions(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The predicted tokens ``[rows, L]`` (argmax of the last stage's logits) of one
        validation batch, forward only (the stage walk of :meth:`forward_outputs`, without
        labels); on every pp rank."""
        rows, length = batch["input_ids"].shape
        merged = merge_micro_batches([batch], self._global_length(length), self.row_inputs)
        merged = self._eval_rows(merged)
        del merged["labels"]  # the last stage then returns its logits
        n_micro = merged["input_ids"].shape[0] // (self.microbatch_size or 1)
        outs = self.forward_outputs(merged, n_micro)
        if dist.get_rank(self.pp_group) == self.last_rank:
            pred = torch.cat([o.argmax(-1) for o in outs])[:rows, :length].contiguous()
        else:
            pred = torch.empty(rows, length, dtype=torch.long, device=self.device)
        dist.broadcast(pred, group=self.pp_group, group_src=self.last_rank)
        return pred
