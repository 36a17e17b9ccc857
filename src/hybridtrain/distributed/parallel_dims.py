"""Parallel degrees and the named device meshes built from them.

Ranks are laid out, slowest-varying first, as ``pp × dp_replicate × dp_shard × cp × tp``
(torchtitan's order: tensor parallel ranks are neighbours, pipeline stages are far apart).
Expert parallelism does not add ranks: its ``ep`` ranks are borrowed from the inner part of
``dp_shard × cp``, and the remaining ``dp_shard·cp / ep`` ranks (``efsdp``, a.k.a.
``dp_shard_mod_ep``) shard the expert parameters with FSDP.

Every mesh is built once, by :meth:`ParallelDims.build_mesh`, as a few *views* of the same
rank layout, each a public :class:`~torch.distributed.device_mesh.DeviceMesh`:

====================  ===============================================
view                  dims
====================  ===============================================
world                 ``pp, dp_replicate, dp_shard, cp, tp``
fsdp                  ``pp, dp_replicate, dp_shard_cp, tp``
dp                    ``pp, dp, cp, tp``         (``dp = dp_replicate·dp_shard``)
dp_cp                 ``pp, dp_cp, tp``
expert                ``pp, dp_replicate, efsdp, ep, tp``
====================  ===============================================

``dims.mesh("dp_shard_cp")`` or ``dims.mesh("dp_replicate", "dp_shard_cp")`` returns the
(sub)mesh with those names. A degree of 1 is simply a dimension of size 1.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from hybridtrain.config.keys import recipe_key

__all__ = ["ParallelDims", "forget_meshes"]

_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")

# The meshes built in this process, by device type, ranks and shapes, with the default process
# group they were built in: a process that builds a layout again (the RL policy, a test's runs)
# reuses their process groups instead of making new ones (gloo keeps two threads a group and a
# TCP loop that wakes every 10 ms: a few hundred groups took a core's tenth while idle).
# ``forget_meshes`` empties it when the default group goes (hybridtrain.distributed.init).
_BUILT: dict[tuple, tuple[Any, dict[str, Any], Any]] = {}


def forget_meshes() -> None:
    """Drop the meshes built in this process (before the default process group is destroyed)."""
    _BUILT.clear()

# name of each view -> its dim names (all views share the rank layout)
_VIEWS: dict[str, tuple[str, ...]] = {
    "world": ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    "fsdp": ("pp", "dp_replicate", "dp_shard_cp", "tp"),
    "dp": ("pp", "dp", "cp", "tp"),
    "dp_cp": ("pp", "dp_cp", "tp"),
    "expert": ("pp", "dp_replicate", "efsdp", "ep", "tp"),
}
_ALIASES = {"dp_shard_mod_ep": "efsdp"}


def _fmt(names: tuple[str, ...], values: dict[str, int]) -> str:
    """'tp·cp·pp = 3 (tp=1, cp=1, pp=3)'"""
    prod = 1
    for n in names:
        prod *= values[n]
    return f"{'·'.join(names)} = {prod} ({', '.join(f'{n}={values[n]}' for n in names)})"


@dataclass
class ParallelDims:
    """Parallel degrees of a run; ``dp_shard=-1`` takes the ranks the other degrees leave.

    Raises ``ValueError`` (naming the degrees and the product that must divide the world
    size) for a layout that does not fit ``world_size``.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1
    _meshes: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _ranks_group: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in _DEGREES + ("world_size",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{recipe_key(name)} must be an integer (got {value!r})")
            if value < 1 and not (name == "dp_shard" and value == -1):
                hint = " (or -1 for 'all remaining ranks')" if name == "dp_shard" else ""
                raise ValueError(f"{recipe_key(name)} must be >= 1{hint} (got {value})")
        world = self.world_size
        v = {n: getattr(self, n) for n in _DEGREES}
        # the fewest ranks the layout runs on (dp_shard=-1: enough shards to hold ep)
        shard = self.dp_shard if self.dp_shard > 0 else self.ep // math.gcd(self.ep, self.cp)
        need = self.dp_replicate * shard * self.cp * self.tp * self.pp
        if world < need:
            set_ = {n: x for n, x in v.items() if x > 1}
            raise ValueError(
                f"this layout ({', '.join(f'{n}={x}' for n, x in set_.items())}) needs {need} "
                f"ranks but the run has {world}; add --nproc-per-node {need} (or launch "
                f"{need} processes with torchrun), or lower the distributed degrees")
        if world % (self.tp * self.cp * self.pp):
            raise ValueError(
                f"world size {world} is not divisible by {_fmt(('tp', 'cp', 'pp'), v)}"
            )
        if self.dp_shard == -1:
            others = ("dp_replicate", "tp", "cp", "pp")
            if world % (self.dp_replicate * self.tp * self.cp * self.pp):
                raise ValueError(f"world size {world} is not divisible by {_fmt(others, v)}")
            self.dp_shard = world // (self.dp_replicate * self.tp * self.cp * self.pp)
            v["dp_shard"] = self.dp_shard
        else:
            names = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
            if self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp != world:
                raise ValueError(
                    f"{_fmt(names, v)} does not equal the world size {world}; "
                    f"set {recipe_key('dp_shard')}: -1 to give data-parallel sharding the "
                    "remaining ranks"
                )
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide {_fmt(('dp_shard', 'cp'), v)}: expert parallelism "
                "borrows its ranks from the data-parallel shard and context-parallel ranks"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def dp(self) -> int:
        """Number of distinct data streams (ranks that see different batches)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks that FSDP-shard each expert (the complement of ``ep`` in ``dp_shard·cp``)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_cp > 1 or self.dp_replicate > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def degrees(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def check_experts(self, n_routed_experts: int) -> None:
        """``n_routed_experts`` must split evenly over ``ep``."""
        if n_routed_experts % self.ep:
            raise ValueError(
                f"n_routed_experts={n_routed_experts} is not divisible by ep={self.ep}: "
                "each expert-parallel rank must hold the same number of experts; "
                "choose an ep that divides the number of routed experts"
            )

    # ------------------------------------------------------------------ meshes
    def _shape(self, view: str) -> tuple[int, ...]:
        size = {
            "pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
            "cp": self.cp, "tp": self.tp, "dp_shard_cp": self.dp_shard_cp, "dp": self.dp,
            "dp_cp": self.dp_cp, "efsdp": self.efsdp, "ep": self.ep,
        }
        return tuple(size[n] for n in _VIEWS[view])

    def build_mesh(self, device_type: str, first_rank: int = 0) -> "ParallelDims":
        """Build every named mesh once (a collective: all ranks must call it). The layout
        spans ranks ``first_rank .. first_rank + world_size - 1`` (the whole process group by
        default; a part of it when other ranks run other modules of the model, where the
        other ranks build it too and take no part in it)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        assert dist.is_initialized(), "init_distributed() must run before build_mesh()"
        assert (first_rank == 0 and dist.get_world_size() == self.world_size) or (
            first_rank + self.world_size <= dist.get_world_size()), (
            f"ParallelDims.world_size={self.world_size} from rank {first_rank} but the process "
            f"group has {dist.get_world_size()} ranks"
        )
        key = (device_type, first_rank, self.world_size, tuple(self._shape(v) for v in _VIEWS))
        cached = _BUILT.get(key)
        if cached is not None and cached[0] is dist.group.WORLD:
            _, self._meshes, self._ranks_group = cached
            return self
        ranks = torch.arange(first_rank, first_rank + self.world_size, dtype=torch.int)
        self._meshes = {view: DeviceMesh(device_type, ranks.view(self._shape(view)), mesh_dim_names=names)
                        for view, names in _VIEWS.items()}
        if self.world_size != dist.get_world_size():
            self._ranks_group = dist.new_group(ranks.tolist())
        # (the default group is held, so a later one cannot take its id: `is` tells them apart)
        _BUILT[key] = (dist.group.WORLD, self._meshes, self._ranks_group)
        return self

    @property
    def ranks_group(self):
        """The process group of all the layout's ranks (None: the default group, all ranks)."""
        return self._ranks_group

    @property
    def world_mesh(self):
        return self.mesh(*_VIEWS["world"])

    def mesh(self, *names: str):
        """The (sub)mesh spanning ``names`` (in layout order), e.g. ``mesh('dp_replicate',
        'dp_shard_cp')``."""
        assert self._meshes, "build_mesh() has not run"
        names = tuple(_ALIASES.get(n, n) for n in names)
        for view, dims in _VIEWS.items():
            if all(n in dims for n in names):
                idx = [dims.index(n) for n in names]
                assert idx == sorted(idx), f"mesh dims {names} must be given in layout order {dims}"
                m = self._meshes[view]
                return m if names == dims else m[names if len(names) > 1 else names[0]]
        raise KeyError(f"no mesh has dims {names}; known views: {_VIEWS}")

    def group(self, name: str):
        """The process group of one named mesh dimension."""
        return self.mesh(name).get_group()

    def local_rank(self, name: str) -> int:
        """This rank's coordinate along one named dimension."""
        if not self._meshes:
            return 0
        return self.mesh(name).get_local_rank()

    # ------------------------------------------------------------------ this process
    @property
    def built(self) -> bool:
        """Whether the meshes exist (a single process never builds them)."""
        return bool(self._meshes)

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel rank: which share of each global batch it reads."""
        return self.local_rank("dp")

    @property
    def dp_group(self):
        """The data-parallel process group (label counts, loss sums); None in one process."""
        return self.group("dp") if self._meshes else None

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the data-parallel ranks in place (nothing in one process)."""
        if self._meshes and self.dp > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
        return t

    @property
    def cp_rank(self) -> int:
        """This process's context-parallel rank: which slice of every row it holds."""
        return self.local_rank("cp")

    @property
    def sums_over_ranks(self) -> bool:
        """Whether :meth:`all_reduce_dp_cp` sums over other ranks (else it leaves ``t`` as is)."""
        return bool(self._meshes) and self.dp * self.cp > 1

    def all_reduce_dp_cp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks holding different tokens (data- and context-parallel) in
        place; the data-parallel sum when ``cp`` is 1."""
        if self._meshes and self.cp > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group("dp_cp"))
            return t
        return self.all_reduce_dp(t)

    # fsdp meshes: HSDP (2-D) when dp_replicate > 1, plain FSDP (1-D) otherwise
    def dense_fsdp_mesh(self):
        if self.dp_replicate > 1:
            return self.mesh("dp_replicate", "dp_shard_cp")
        return self.mesh("dp_shard_cp")

    def expert_fsdp_mesh(self):
        if self.dp_replicate > 1:
            return self.mesh("dp_replicate", "efsdp")
        return self.mesh("efsdp")
