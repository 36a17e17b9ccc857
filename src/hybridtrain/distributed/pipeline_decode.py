"""Generation through a pipeline: the stages run in order on their ranks for every forward of the
decoding loop (the prompt's prefill, then one token per step).

The first stage embeds the tokens and runs its layers with its own cache; each stage sends its
hidden states to the next stage's rank (point-to-point over the pp group; stages on the same rank
hand them over directly); the last stage's rank computes the logits and picks the tokens, which
:meth:`PipelineDecoder.share_tokens` broadcasts to every pp rank, so that the first stage can
embed them and every rank returns the same sequences. The model supplies what one stage does
(``fn(stage_id, stage, inputs)``); the decoding loop is ``ops.sampling.decode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from hybridtrain.distributed.pipeline_layout import stage_rank

__all__ = ["PipelineDecoder"]


class PipelineDecoder:
    """This rank's ``stages`` (ids ``stage_ids``) of a chain of ``num_stages`` over ``group``;
    ``owners[s]``: the pp rank that runs stage ``s``; hidden states travel as [b, L,
    ``hidden_size``] in ``hidden_dtype``."""

    def __init__(self, stages: Sequence[nn.Module], stage_ids: Sequence[int], num_stages: int, group,
                 owners: Sequence[int], hidden_size: int, hidden_dtype: torch.dtype, device: torch.device):
        assert len(stages) == len(stage_ids) and len(owners) == num_stages, (stage_ids, owners)
        self.stages, self.stage_ids = list(stages), list(stage_ids)
        self.num_stages, self.group, self.owners = num_stages, group, list(owners)
        self.hidden_size, self.hidden_dtype, self.device = hidden_size, hidden_dtype, torch.device(device)
        self.rank = dist.get_rank(group)
        assert all(self.owners[s] == self.rank for s in self.stage_ids), (self.stage_ids, self.owners)
        self._rows = 0

    @classmethod
    def of(cls, step) -> "PipelineDecoder":
        """The decoder over the stages of a ``distributed.pipeline.PipelineTrainStep``."""
        owners = [stage_rank(s, step.pp, step.spec.style) for s in range(step.num_stages)]
        return cls(step.stages, step.stage_ids, step.num_stages, step.pp_group, owners,
                   step.hidden_size, step.hidden_dtype, step.device)

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def run(self, fn: Callable[[int, nn.Module, torch.Tensor], torch.Tensor], tokens: torch.Tensor
            ) -> torch.Tensor | None:
        """One forward of the chain on ``tokens`` ([b, L] prompt or [b] step): ``fn(stage_id,
        stage, inputs)`` returns a stage's output (hidden states; logits on the last stage).
        Returns the last stage's output on its rank, None on the others."""
        b, L = tokens.shape[0], (tokens.shape[1] if tokens.dim() == 2 else 1)
        self._rows = b
        stage_of = dict(zip(self.stage_ids, self.stages))
        prev, out = None, None
        for s in range(self.num_stages):
            if self.owners[s] != self.rank:
                continue
            if s == 0:
                x = tokens
            elif self.owners[s - 1] == self.rank:
                x = prev
            else:
                x = torch.empty(b, L, self.hidden_size, dtype=self.hidden_dtype, device=self.device)
                dist.recv(x, src=self._peer(self.owners[s - 1]), group=self.group)
            y = fn(s, stage_of[s], x)
            if s == self.num_stages - 1:
                out = y
            elif self.owners[s + 1] == self.rank:
                prev = y
            else:
                dist.send(y.to(self.hidden_dtype).contiguous(), dst=self._peer(self.owners[s + 1]),
                          group=self.group)
        return out

    def share_tokens(self, tokens: torch.Tensor | None) -> torch.Tensor:
        """The last stage's tokens [b] on every pp rank."""
        if tokens is None:
            tokens = torch.empty(self._rows, dtype=torch.long, device=self.device)
        tokens = tokens.to(torch.long).contiguous()
        dist.broadcast(tokens, src=self._peer(self.owners[-1]), group=self.group)
        return tokens
