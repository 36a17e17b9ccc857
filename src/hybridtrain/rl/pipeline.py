"""A Policy's pipeline step: the last stage returns per-token values (log-probs ``[rows, L]``, or
top-k logits ``[rows, L, w]``) instead of a CE sum.

* :meth:`PolicyPipeline.forward`: forward only (every schedule: the stage walk of
  :meth:`~hybridtrain.distributed.pipeline.PipelineTrainStep.forward_outputs`); the last stage's
  values are broadcast over the ``pp`` group so every rank returns them.
* :meth:`PolicyPipeline.train`: one schedule step; the schedule's loss of micro-batch ``i`` is
  ``finish(i, values)`` (the caller's loss share, normalised by global counts;
  ``scale_grads=False``), run on the last stage's rank only.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from hybridtrain.data.micro_batches import merge_micro_batches
from hybridtrain.distributed.pipeline import PipelineTrainStep, _grads_in_param_layout

__all__ = ["PolicyPipeline"]


class PolicyPipeline(PipelineTrainStep):
    """Built from the plan's :class:`PipelineTrainStep` (same stages, group and schedule); the
    micro-batches are the Policy's (``pp_microbatch_size`` does not apply)."""

    def __init__(self, step: PipelineTrainStep):
        super().__init__(step.stages, step.stage_ids, step.num_stages, step.pp_group, step.device,
                         step.hidden_size, step.hidden_dtype, schedule=step.spec.name)
        self._finish: Callable | None = None

    @property
    def is_last(self) -> bool:
        return dist.get_rank(self.pp_group) == self.last_rank

    def _stage_meta(self, sid: int, rows: int, length: int):
        inp, out = super()._stage_meta(sid, rows, length)
        if sid == self.num_stages - 1:
            out = torch.empty(rows, length, dtype=torch.float32, device="meta")
        return inp, out

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._finish(int(target[0]), output)

    def _merged(self, micro_batches: Sequence[dict]) -> tuple[dict, int, int]:
        rows = {mb["input_ids"].shape[0] for mb in micro_batches}
        assert len(rows) == 1, f"pipeline micro-batches need equal row counts, got {rows}"
        length = self._global_length(max(mb["input_ids"].shape[1] for mb in micro_batches))
        return merge_micro_batches(micro_batches, length), rows.pop(), length

    def forward(self, micro_batches: Sequence[dict], trailing: tuple[int, ...] = ()
                ) -> list[torch.Tensor]:
        """The last stage's output ``[rows, L, *trailing]`` of every micro-batch (L: the longest
        micro-batch of all ranks), on every pp rank."""
        batch, rows, length = self._merged(micro_batches)
        n = len(micro_batches)
        with torch.no_grad():
            outs = self.forward_outputs(batch, n)
        if self.is_last:
            values = torch.cat([o.float() for o in outs]).contiguous()
        else:
            values = torch.empty((n * rows, length) + tuple(trailing), dtype=torch.float32,
                                 device=self.device)
        dist.broadcast(values, group=self.pp_group, group_src=self.last_rank)
        return list(values.split(rows))

    def train(self, micro_batches: Sequence[dict], finish: Callable[[int, torch.Tensor], torch.Tensor]
              ) -> None:
        """Forward and backward of every micro-batch; ``finish(i, values [rows, L])`` -> the loss
        share of micro-batch ``i`` (called on the last stage's rank)."""
        batch, rows, length = self._merged(micro_batches)
        n = len(micro_batches)
        sched = self._schedule(n, rows, length, train=True)
        self._finish = finish
        target = torch.arange(n, device=self.device).repeat_interleave(rows)
        args = (batch["input_ids"],) if 0 in self.stage_ids else ()
        try:
            sched.step(*args, target=target, return_outputs=False,
                       position_ids=batch["position_ids"], labels=batch["labels"])
        finally:
            self._finish = None
        if self.spec.split_backward:
            _grads_in_param_layout(self.stages)
