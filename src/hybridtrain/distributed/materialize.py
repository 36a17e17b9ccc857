"""Materialise a model built on the meta device and laid out (FSDP2, pipeline stages, expert
slices): each rank allocates only the tensors it owns and fills them straight from their source.

    model = <built under torch.device("meta")>; plan = parallelize(...)
    materialize(plan.model, device, read=reader, read_names=base_names, units=init_units, seed=s)

Sources, by parameter name (the model's state-dict names):

* ``read(name, region) -> Tensor``: ``region`` (a tuple of slices) of the full tensor ``name``,
  e.g. a checkpoint reader that reads only those bytes (:class:`SafetensorsReader` is the
  generic one; a model maps its parameter names to the checkpoint's through its spec).
* :class:`InitUnit`: random initialisation, a group of tensors made together by ``make()``
  (e.g. one block's ``reset_parameters``) under the global RNG seeded from ``(seed, key)``
  only. A unit's values thus depend on the seed and its name, never on the layout, on which
  other units exist on a rank, or on the order they are made in. A rank makes a unit's full
  tensors (one unit at a time) and keeps its slices.

A rank's extra memory while materialising is one slice (reading) or one unit (initialising).

Packed parameters (a tensor subclass holding its own storage format, e.g. QLoRA's NF4 base
weights) are allocated packed by ``to_empty`` and rebuilt by ``pack(name, param, source) ->
local``, where ``source(region)`` reads (or slices the initialised) source tensor: the new local
tensor replaces the parameter on its module (a DTensor keeps its mesh and placements).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from hybridtrain.distributed.utils import local_tensor
from hybridtrain.fileio import decode_utf8, json_loads

__all__ = ["Region", "InitUnit", "SafetensorsReader", "local_region", "module_init_units",
           "unit_seed", "materialize"]

Region = tuple[slice, ...]

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _compute_local_shape_and_global_offset():
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as e:  # pragma: no cover - depends on the torch version
        raise RuntimeError(
            "materialising a sharded model needs torch.distributed.tensor._utils."
            f"compute_local_shape_and_global_offset, which torch {torch.__version__} does not "
            "provide (torch 2.5 - 2.13 do)") from e
    return compute_local_shape_and_global_offset


def local_region(t: torch.Tensor) -> Region:
    """The region of the full tensor that this rank's local tensor of ``t`` holds."""
    if not hasattr(t, "device_mesh"):
        return tuple(slice(0, n) for n in t.shape)
    shape, offset = _compute_local_shape_and_global_offset()(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def unit_seed(seed: int, key: str) -> int:
    """The RNG seed of the init unit ``key`` under the run's ``seed``."""
    return (int(seed) * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


@dataclass(frozen=True)
class InitUnit:
    """Tensors initialised together: ``make()`` returns the full tensors ``{name: tensor}`` (on
    the CPU) of (at least) ``names``, drawing from the global RNG, which :func:`materialize`
    seeds from ``key`` first."""

    key: str
    names: tuple[str, ...]
    make: Callable[[], Mapping[str, torch.Tensor]]


def module_init_units(model: nn.Module,
                      units: Iterable[tuple[str, Callable[[nn.Module], None]]]) -> list[InitUnit]:
    """:class:`InitUnit` s from ``(submodule name, init function)`` pairs of ``model`` (a
    meta-device copy of the model, e.g. its spec's ``init_units``): a unit allocates its
    submodule on the CPU, runs the init function on it and gives its state dict; the storage is
    released (back to the meta device) by the next unit."""
    out = []
    for prefix, init in units:
        sub = model.get_submodule(prefix)
        pre = f"{prefix}." if prefix else ""
        names = tuple(pre + n for n in sub.state_dict())

        def make(sub=sub, init=init, pre=pre):
            sub.to_empty(device="cpu")
            with torch.no_grad():
                init(sub)
            sd = {pre + n: t for n, t in sub.state_dict().items()}
            sub.to_empty(device="meta")  # the tensors in sd stay alive until the caller drops them
            return sd

        out.append(InitUnit(prefix, names, make))
    return out


class SafetensorsReader:
    """Reads regions of the tensors of safetensors files without mapping or reading the rest:
    the rows of dim 0 the region spans are read with one ``pread``, then sliced."""

    def __init__(self, files: Iterable[str]):
        self.index: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        for path in files:
            path = os.fspath(path)
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError(f"{path}: not a safetensors file (shorter than its header)")
                (n,) = struct.unpack("<Q", head)
                if 8 + n > size:
                    raise ValueError(f"{path}: truncated safetensors file (header of {n} bytes, "
                                     f"file of {size})")
                try:
                    header = json_loads(decode_utf8(f.read(n), path))
                except json.JSONDecodeError as e:
                    header = e
                if not isinstance(header, dict):
                    raise ValueError(f"{path}: corrupt safetensors file (its header is not a "
                                     "JSON object); copy or download it again")
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                if 8 + n + end > size:
                    raise ValueError(f"{path}: truncated safetensors file (tensor {name} ends at "
                                     f"byte {8 + n + end}, the file has {size}); copy it again")
                if name in self.index:
                    raise ValueError(f"tensor {name} appears in both {self.index[name][0]} and "
                                     f"{path}")
                self.index[name] = (path, info["dtype"], tuple(info["shape"]), 8 + n + begin,
                                    end - begin)

    def keys(self):
        return self.index.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name][2]

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """``region`` of tensor ``name`` (None: all of it), as stored (dtype)."""
        path, st_dtype, shape, start, nbytes = self.index[name]
        dtype = _ST_DTYPES[st_dtype]
        full = tuple(slice(0, n) for n in shape)
        region = tuple(region or ()) + full[len(region or ()):]
        assert len(region) == len(shape), (name, region, shape)
        rows = region[0] if shape else slice(0, 1)
        n_rows = shape[0] if shape else 1
        a, b = rows.indices(n_rows)[:2]
        row_bytes = nbytes // n_rows if n_rows else 0
        buf = bytearray(max(b - a, 0) * row_bytes)
        if buf:
            with open(path, "rb") as f:
                if os.preadv(f.fileno(), [buf], start + a * row_bytes) != len(buf):
                    raise ValueError(f"{path}: truncated safetensors file (tensor {name})")
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        if not shape:
            return t.reshape(())
        t = t.view(max(b - a, 0), *shape[1:])
        if region[1:] != full[1:]:
            t = t[(slice(None),) + region[1:]].contiguous()
        return t


def _is_packed(t: torch.Tensor) -> bool:
    return type(local_tensor(t.detach())) is not torch.Tensor


def _owners(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id(parameter) -> (module, attribute) of every packed parameter of ``model``."""
    return {id(p): (mod, n) for mod in model.modules()
            for n, p in mod.named_parameters(recurse=False) if _is_packed(p)}


def _replace(owner: tuple[nn.Module, str], t: torch.Tensor, local: torch.Tensor) -> None:
    mod, attr = owner
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import DTensor

        local = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape,
                                   stride=t.stride(), run_check=False)
    setattr(mod, attr, nn.Parameter(local, requires_grad=False))


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str, *,
                read: Callable[[str, Region], torch.Tensor] | None = None,
                read_names: Iterable[str] = (), units: Iterable[InitUnit] = (),
                seed: int = 0,
                pack: Callable[[str, torch.Tensor, Callable[[Region], torch.Tensor]], torch.Tensor]
                | None = None) -> None:
    """Allocate ``model``'s tensors (this rank's shards only) on ``device`` and fill each one:
    the names in ``read_names`` through ``read``, the others from the first of ``units`` that
    names them; packed parameters through ``pack`` (see the module docstring). Every parameter
    and buffer must be covered (AssertionError otherwise)."""
    model.to_empty(device=device)
    targets = model.state_dict(keep_vars=True)
    owners = _owners(model)
    assert pack is not None or not owners, "packed parameters need a pack function"
    pending = dict(targets)
    read_names = set(read_names)

    def fill(name: str, t: torch.Tensor, source: Callable[[Region], torch.Tensor]) -> None:
        if id(t) in owners:
            _replace(owners[id(t)], t, pack(name, t, source))
            return
        local = local_tensor(t.detach())
        if local.numel():
            local.copy_(source(local_region(t)))

    if read is not None:
        for name, t in targets.items():
            if name not in read_names:
                continue
            fill(name, t, lambda region, name=name: read(name, region))
            del pending[name]
    for unit in units:
        need = [n for n in unit.names if n in pending]
        if not need:
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(seed, unit.key))
            full = unit.make()
        for n in need:
            fill(n, pending.pop(n), lambda region, n=n: full[n][region])
        del full
    assert not pending, f"no source for {sorted(pending)[:8]}"
