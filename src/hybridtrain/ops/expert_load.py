"""Expert load of a model's mixture-of-experts layers over a training step, and the
aux-loss-free balancing of their routers (DeepSeek-V3's rule, as Megatron applies it).

Each MoE layer's router writes how many of the forward's token copies it sent to each expert
(a device tensor [E], overwritten by every forward, so a block recomputed under activation
checkpointing counts once); the model adds its layers' counts to :class:`ExpertLoad` once per
training forward. Per step the trainer sums them over all ranks (data, expert, context and
pipeline parallel: tensor-parallel replicas scale every count alike, which changes no ratio),
records the load metrics and, after a successful optimizer step, moves each router's
``e_score_correction_bias`` by ``rate`` toward its under-loaded experts::

    bias += rate * sign(mean(counts) - counts)

Every rank applies the same update from the same summed counts, so the replicated biases stay
equal. ``rate == 0`` changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch


class ExpertLoad:
    """``layers``: the names of every MoE layer of the whole model (the rows of the step's
    table); ``num_experts``: experts per layer; ``biases()``: this rank's layers' correction
    biases by name (the tensors the update changes in place); ``rate``: the bias update rate."""

    def __init__(self, layers: Sequence[str], num_experts: int,
                 biases: Callable[[], Mapping[str, torch.Tensor]], rate: float = 0.0):
        self.layers, self.num_experts, self.biases, self.rate = list(layers), num_experts, biases, float(rate)
        self.row = {name: i for i, name in enumerate(self.layers)}
        self._table: torch.Tensor | None = None
        self._active = False

    @property
    def active(self) -> bool:
        return self._active and torch.is_grad_enabled()

    def begin_step(self, device: torch.device | str) -> None:
        self._table = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64, device=device)
        self._active = True

    def add(self, counts: Mapping[str, torch.Tensor]) -> None:
        """One forward's token copies per expert of the layers this rank holds."""
        if not self.active:
            return
        for name, c in counts.items():
            self._table[self.row[name]] += c.to(self._table.device, torch.int64)

    def end_step(self) -> torch.Tensor:
        """This rank's table of the step [layers, experts] (to sum over all ranks)."""
        self._active = False
        assert self._table is not None, "end_step without begin_step"
        return self._table

    def record(self, table: torch.Tensor) -> dict[str, float | None]:
        """``moe_max_load``: over layers, the largest busiest-expert share over the uniform share
        (1.0: perfectly balanced); ``moe_idle_experts``: the mean fraction of experts that got
        no token; ``moe_max_load_layer``: the layer with the largest one."""
        t = table.double()
        total = t.sum(1)
        seen = total > 0
        if not bool(seen.any()):
            return {"moe_max_load": None, "moe_idle_experts": None}
        ratio = (t.max(1).values * self.num_experts / total.clamp(min=1))[seen]
        idle = (t == 0).double().mean(1)[seen]
        worst = int(torch.nonzero(seen)[int(ratio.argmax())])
        return {"moe_max_load": float(ratio.max()), "moe_idle_experts": float(idle.mean()),
                "moe_max_load_layer": self.layers[worst]}

    @torch.no_grad()
    def update_biases(self, table: torch.Tensor) -> None:
        """The sign update of every held router's correction bias (see the module docstring)."""
        if not self.rate:
            return
        for name, bias in self.biases().items():
            counts = table[self.row[name]].to(bias.device, torch.float64)
            offset = counts.mean() - counts  # (a layer without tokens: all zero, no change)
            bias.add_(torch.sign(offset).to(bias.dtype), alpha=self.rate)
