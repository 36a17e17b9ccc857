"""A training step that does not wait on the host.

A step is skipped when its loss or gradient norm is not finite. Reading either on the host
would stop the CPU until the GPU has finished the step, so the CPU could never queue the next
step's kernels ahead. Instead:

* the skip is decided on the device: the fused AdamW takes the flag as its ``found_inf``
  (the tensor ``torch.amp.GradScaler`` hands it): where it is 1 no parameter, moment or step
  count moves (:func:`fused_step`);
* the loss and norm are copied to host memory without waiting (:class:`PendingStep`), and read
  one step later, when the device finished them long ago: then the record is filled, a skip
  counted, and the LR schedule advanced for an applied update (before the next update uses it).

An optimizer without the ``found_inf`` path (``optimizer.implementation: foreach`` or
``for_loop``) reads the flag at once instead: the step then waits on the device
(:func:`supports_device_skip`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def supports_device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips its update on a device flag: torch's fused Adam / AdamW."""
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
            and bool(optimizer.defaults.get("fused")))


def fused_step(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """``optimizer.step()`` that changes nothing where ``nonfinite`` (a float32 0/1 tensor on
    the device) is 1: the ``found_inf`` argument of torch's fused Adam kernels, set as
    ``torch.amp.GradScaler.step`` sets it, for this one call."""
    assert supports_device_skip(optimizer), "fused_step needs torch's fused Adam / AdamW"
    optimizer.found_inf = nonfinite
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


@dataclass
class PendingStep:
    """A step whose loss and gradient norm are still on the device.

    ``values``: ``[loss, grad_norm]`` (float64) in host memory, filled by a copy that does not
    wait; ``event``: recorded after that copy on CUDA (None on CPU, where ``values`` is the
    tensor itself); ``nonfinite``: the device flag (float32 0/1) the update is skipped on."""

    record: dict[str, Any]
    values: torch.Tensor
    event: Any
    nonfinite: torch.Tensor
    _read: bool = False

    @classmethod
    def of(cls, record: dict[str, Any], values: torch.Tensor) -> "PendingStep":
        values = values.detach()
        nonfinite = torch.logical_not(torch.isfinite(values).all()).float()
        event = None
        if values.device.type == "cuda":  # pragma: no cover - CUDA only
            values = values.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return cls(record, values, event, nonfinite)

    def read(self) -> dict[str, Any]:
        """Waits for the copy (on CUDA) and fills ``loss`` / ``grad_norm`` of the record."""
        if not self._read:
            if self.event is not None:  # pragma: no cover - CUDA only
                self.event.synchronize()
            loss, grad_norm = self.values.tolist()  # host memory: no device read
            self.record.update(loss=loss, grad_norm=grad_norm)
            self._read = True
        return self.record

    @property
    def skipped(self) -> bool:
        rec = self.read()
        return not (rec["num_label_tokens"] and _finite(rec["loss"]) and _finite(rec["grad_norm"]))


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
