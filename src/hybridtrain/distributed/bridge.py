"""A bridge between two disjoint rank sets that run different modules of one model (e.g. an
encoder on ranks ``0..E-1`` and the model that consumes its output on the others): each
receiving lane gets the activations of its own samples and sends their gradients back.

::

    BridgeLayout(senders: list[int], receivers: list[int])
        .routes(sender_rank)   -> [(receiver_rank, share, num_shares)]  what a sender serves
        .sources(receiver_rank) -> [sender_rank, ...]   who serves a receiver, in share order
    send_2d(t, dst) / recv_2d(src, dtype)   shape first, then data (sizes vary per batch)
    split_shares(n, k) -> [(start, end)]    contiguous shares of n items over k senders

Layouts: with fewer senders than receivers (fan-out) sender ``i`` serves receivers
``i*r .. (i+1)*r - 1`` whole (``r = R / S``); with more (fan-in) receiver ``j`` is served by
senders ``j*s .. (j+1)*s - 1``, each with one contiguous share of its items (``s = S / R``).
An empty share still crosses (a ``[0, H]`` tensor), so both sides stay in step. Point-to-point
messages use global ranks on the default process group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["BridgeLayout", "send_2d", "recv_2d", "split_shares"]


@dataclass(frozen=True)
class BridgeLayout:
    senders: tuple[int, ...]
    receivers: tuple[int, ...]

    def __init__(self, senders: Iterable[int], receivers: Iterable[int]):
        s, r = tuple(senders), tuple(receivers)
        if not s or not r or set(s) & set(r):
            raise ValueError(f"bridge: sender ranks {list(s)} and receiver ranks {list(r)} must "
                             "be non-empty and disjoint")
        if max(len(s), len(r)) % min(len(s), len(r)):
            raise ValueError(f"bridge: {len(s)} sending and {len(r)} receiving lanes: one count "
                             "must divide the other (fan-in or fan-out)")
        object.__setattr__(self, "senders", s)
        object.__setattr__(self, "receivers", r)

    def routes(self, sender: int) -> list[tuple[int, int, int]]:
        i, S, R = self.senders.index(sender), len(self.senders), len(self.receivers)
        if S <= R:
            per = R // S
            return [(self.receivers[j], 0, 1) for j in range(i * per, (i + 1) * per)]
        k = S // R
        return [(self.receivers[i // k], i % k, k)]

    def sources(self, receiver: int) -> list[int]:
        j, S, R = self.receivers.index(receiver), len(self.senders), len(self.receivers)
        if S <= R:
            return [self.senders[j // (R // S)]]
        k = S // R
        return list(self.senders[j * k:(j + 1) * k])


def split_shares(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous [start, end) shares of ``n`` items, sizes differing by at most one."""
    return [(s * n // k, (s + 1) * n // k) for s in range(k)]


def send_2d(t: torch.Tensor, dst: int) -> int:
    """Send a 2-D tensor (shape first); returns the bytes sent."""
    assert t.dim() == 2, t.shape
    dist.send(torch.tensor(list(t.shape), dtype=torch.int64), dst)
    if t.numel():
        dist.send(t.detach().contiguous(), dst)
    return 16 + t.numel() * t.element_size()


def recv_2d(src: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    shape = torch.empty(2, dtype=torch.int64)
    dist.recv(shape, src)
    out = torch.empty(*shape.tolist(), dtype=dtype, device=device)
    if out.numel():
        dist.recv(out, src)
    return out
