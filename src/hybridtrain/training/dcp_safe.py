"""Reading a ``torch.distributed.checkpoint`` folder as data, never as code.

DCP keeps its index in ``.metadata``, a pickle, and ``FileSystemReader.read_metadata`` unpickles it
with ``pickle.load``: a replaced ``.metadata`` would run whatever it names. Here the index is
read by :class:`MetadataUnpickler`, which admits only the classes DCP's metadata consists of
(:data:`METADATA_CLASSES`: the ``torch.distributed.checkpoint.metadata`` dataclasses, the
filesystem's storage record, ``torch.Size``, dtypes, layouts, memory formats, paths); any other
global is refused with an error naming the file. The index is then checked: every entry is a
tensor (hybridtrain writes nothing else through DCP; DCP reads a non-tensor entry with
``torch.load(weights_only=False)``, so such an entry is refused too) stored in a file directly
inside the folder. Tensor data itself is read by DCP with ``torch.load(weights_only=True)``.

:class:`SafeFileSystemReader` is a ``FileSystemReader`` (the public ``StorageReader``
interface) whose ``read_metadata`` does this; pass it as ``dcp.load(..., storage_reader=...)``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (Metadata, StorageMeta,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType

__all__ = ["METADATA_FILE", "METADATA_CLASSES", "UnsafeCheckpointError", "MetadataUnpickler",
           "read_metadata", "SafeFileSystemReader"]

METADATA_FILE = ".metadata"

_DCP = "torch.distributed.checkpoint.metadata"
# (module, name) of every global a DCP .metadata pickle refers to (torch 2.4 - 2.13); each is a
# plain record type or a constructor without side effects
METADATA_CLASSES: frozenset[tuple[str, str]] = frozenset({
    (_DCP, "Metadata"), (_DCP, "StorageMeta"), (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"), (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"),
    (_DCP, "MetadataIndex"),
    (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
})
# torch.float32, torch.strided, torch.contiguous_format, ...: values, not callables
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than the data it should (e.g. code)."""


class MetadataUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves only :data:`METADATA_CLASSES` and torch dtypes,
    layouts and memory formats; ``path`` names the file in the error."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refused to load '{module}.{name}': a checkpoint's DCP index holds only "
            "torch.distributed.checkpoint metadata, and this one names other code (the file was "
            "replaced or is not a checkpoint). Nothing from it was run; use a checkpoint you "
            "wrote, or the previous step (docs/safety.md, 'Untrusted files')")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.path}: a DCP index has no persistent references")


def read_metadata(dcp_dir: str | os.PathLike, name: str = METADATA_FILE) -> Metadata:
    """The checked :class:`Metadata` of the DCP folder ``dcp_dir``. A missing or unreadable file
    is a ``ValueError`` naming it; one that names other code or non-tensor entries, an
    :class:`UnsafeCheckpointError`."""
    path = os.path.join(os.fspath(dcp_dir), name)
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: the checkpoint's DCP index was deleted or never "
                         "written") from None
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, ImportError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: "
                         f"{str(e).strip()[:200]})") from None
    _check(metadata, path)
    return metadata


def _check(metadata: Any, path: str) -> None:
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path} is not a DCP index (it holds a "
                                    f"{type(metadata).__name__})")
    for key, entry in (metadata.state_dict_metadata or {}).items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(
                f"{path}: entry {key!r} is a {type(entry).__name__}, not a tensor; hybridtrain "
                "writes only tensors through DCP, and DCP would unpickle this entry's bytes, "
                "so it is refused")
    for record in (metadata.storage_data or {}).values():
        file = getattr(record, "relative_path", None)
        if not (isinstance(file, str) and file == os.path.basename(file)
                and file not in ("", ".", "..")):
            raise UnsafeCheckpointError(f"{path}: a tensor is stored in {file!r}, which is not "
                                        "a file inside the checkpoint's folder")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose index is read by :func:`read_metadata` (restricted unpickler,
    tensors only) and which refuses any non-tensor read."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(self.path, METADATA_FILE if rank is None
                                 else f"__{rank}{METADATA_FILE}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise UnsafeCheckpointError(
                    f"{self.path}: refused to unpickle the non-tensor entry "
                    f"{item.dest_index.fqn!r}")
        return super().read_data(plan, planner)
