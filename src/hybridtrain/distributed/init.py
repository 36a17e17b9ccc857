"""Process-group start-up: gloo on CPU, NCCL on CUDA (with ``device_id`` bound)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from hybridtrain.distributed.parallel_dims import forget_meshes
from hybridtrain.distributed.parent_watch import launched_by_launcher, watch_parent
from hybridtrain.launch import STORE_ENV, STORE_FD_ENV

log = logging.getLogger(__name__)

__all__ = ["DistInfo", "init_distributed", "destroy_distributed", "dist_env_ranks", "process_group"]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_env_ranks(environ=None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``) or, for tasks started directly by ``srun`` (several tasks, no torchrun),
    from Slurm's (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``)."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and int(env.get("SLURM_NTASKS", 1)) > 1 and "SLURM_PROCID" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        return rank, world, int(env.get("SLURM_LOCALID", 0))
    rank = int(env.get("RANK", 0))
    world = int(env.get("WORLD_SIZE", 1))
    local = int(env.get("LOCAL_RANK", rank))
    return rank, world, local


def init_distributed(
    device: str | torch.device | None = None,
    backend: str | None = None,
    timeout_minutes: float = 10.0,
) -> DistInfo:
    """Start the default process group when launched with more than one rank.

    ``device``: ``"cuda"``/``"cpu"``/``None`` (auto: CUDA when available). On CUDA each rank
    uses ``cuda:LOCAL_RANK`` and NCCL is initialised eagerly with ``device_id`` so that mesh
    sub-groups are created by communicator splitting; on CPU the backend is gloo.
    ``backend`` overrides the choice (e.g. ``"cpu:gloo,cuda:nccl"``). A single process
    (``WORLD_SIZE`` unset or 1) starts no process group.
    """
    rank, world, local_rank = dist_env_ranks()
    if device is None or str(device) == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device_type = torch.device(device).type
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but torch.cuda.is_available() is False")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are "
                "visible; launch at most that many processes per node (--nproc-per-node)"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(device_type)
    if world > 1 and not dist.is_initialized():
        if timeout_minutes <= 0:
            raise ValueError(f"distributed timeout_minutes must be > 0 (got {timeout_minutes})")
        if backend is None:
            backend = "nccl" if device_type == "cuda" else "gloo"
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(
                f"{world} ranks but {' and '.join(missing)} not set: launch with torchrun (or "
                "`hybridtrain ... --nproc-per-node N`), or export MASTER_ADDR (the first node) "
                "and MASTER_PORT when starting the ranks with srun"
            )
        timeout = datetime.timedelta(minutes=timeout_minutes)
        kwargs = {"store": _launcher_store(rank, world, timeout)}
        if device_type == "cuda":
            kwargs["device_id"] = dev
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout,
                                **kwargs)
        log.info("rank %d/%d: %s process group on %s", rank, world, backend, dev)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def _launcher_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store of a ``--nproc-per-node`` launch (:mod:`hybridtrain.launch`): rank
    0 serves it on the socket the launcher already listens on, the others connect to it.
    ``None`` otherwise (torchrun, srun: ``env://`` from ``MASTER_ADDR``/``MASTER_PORT``)."""
    if os.environ.get(STORE_ENV) != "1":
        return None
    fd = os.environ.pop(STORE_FD_ENV, None) if rank == 0 else None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0, timeout=timeout,
                         master_listen_fd=int(fd) if fd else None)


def destroy_distributed() -> None:
    forget_meshes()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(cfg) -> Iterator[DistInfo]:
    """Start-up and tear-down of the process group for a recipe (``training.device``,
    ``distributed.backend`` / ``timeout_seconds``); every command that trains uses it."""
    if launched_by_launcher():
        watch_parent()  # end with the launcher (torchrun), never run on as an orphan
    backend = None if cfg.distributed.backend == "auto" else cfg.distributed.backend
    device = None if cfg.training.device == "auto" else cfg.training.device
    info = init_distributed(device=device, backend=backend,
                            timeout_minutes=cfg.distributed.timeout_seconds / 60)
    try:
        yield info
    finally:
        if info.world_size > 1:
            destroy_distributed()
