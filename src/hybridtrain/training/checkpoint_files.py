"""The files of a checkpoint step, shared by the writer (:mod:`.checkpoint`), the readers
(:mod:`.checkpoint_reader`) and the export (:mod:`.hf_export`): tensors through DCP (read with the
restricted unpickler of :mod:`.dcp_safe`), everything else as JSON; the saved model config and
state-dict format a resume checks."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
)

from hybridtrain.distributed.utils import is_distributed
from hybridtrain.fileio import (
    atomic_write_json, read_json,
)
from hybridtrain.models.spec import model_spec_for
from hybridtrain.runfolder import STEP_RE
from hybridtrain.training.dcp_safe import (SafeFileSystemReader, UnsafeCheckpointError,
                                           read_metadata)



LATEST = "latest"


FINAL = "final"  # symlink to the step folder holding the finished run's export


# Config keys that do not change the model's function; ignored when comparing on resume.
_CONFIG_IGNORE = {
    "transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures", "auto_map",
    "_attn_implementation", "_attn_implementation_autoset", "_attn_implementation_internal",
    "use_cache", "output_hidden_states", "output_attentions", "return_dict", "_commit_hash",
}


# Frozen parameters (a LoRA run's base weights) are not saved: they come from the base model.
SAVE_OPTIONS = StateDictOptions(ignore_frozen_params=True)


# Loading fills the templates taken with SAVE_OPTIONS (DCP itself fails on a missing key), so
# the frozen parameters absent from them are expected.
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


# -- files ------------------------------------------------------------------------------------
def dcp_save(tensors: dict[str, torch.Tensor], path: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        dcp.save(tensors, checkpoint_id=path, no_dist=not is_distributed())


def dcp_load(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Loads in place into ``tensors`` (plain or DTensor, resharding as needed); the index is
    read as data (:mod:`hybridtrain.training.dcp_safe`: a ``.metadata`` that names code is
    refused). An unreadable shard or metadata file raises :func:`unreadable`'s error."""
    try:
        read_metadata(path)  # checked up front: a clear error, before torch logs its own
    except UnsafeCheckpointError:
        raise
    except ValueError as e:
        raise unreadable(os.path.dirname(path), str(e)) from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        try:
            dcp.load(tensors, storage_reader=SafeFileSystemReader(path),
                     no_dist=not is_distributed())
        except UnsafeCheckpointError:
            raise
        except (Exception, dcp.CheckpointException) as e:  # the latter: each rank's failure
            causes = [c for c, _ in e.failures.values()] if hasattr(e, "failures") else [e]
            unsafe = [c for c in causes if isinstance(c, UnsafeCheckpointError)]
            if unsafe:
                raise unsafe[0] from None
            causes = [c for c, _ in e.failures.values()] if hasattr(e, "failures") else [e]
            detail = "; ".join(map(describe_error, causes))
            raise unreadable(os.path.dirname(path), f"{path} cannot be read ({detail})") from e


def describe_error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def previous_checkpoint(ckpt: str) -> str | None:
    """The newest complete ``step_M`` (M < N) beside the checkpoint ``.../step_N``."""
    run_dir, name = os.path.split(os.path.abspath(ckpt))
    m = STEP_RE.match(name)
    if m is None or not os.path.isdir(run_dir):
        return None
    older = [int(k.group(1)) for k in map(STEP_RE.match, os.listdir(run_dir))
             if k and int(k.group(1)) < int(m.group(1))
             and os.path.isfile(os.path.join(run_dir, k.group(0), "trainer_state.json"))]
    return os.path.join(run_dir, f"step_{max(older)}") if older else None


def unreadable(ckpt: str, detail: str) -> ValueError:
    """The error of a checkpoint that cannot be read: names it and the previous one."""
    prev = previous_checkpoint(ckpt)
    hint = (f"Resume from the previous checkpoint instead: --checkpoint.resume={prev}" if prev
            else "There is no earlier checkpoint beside it to resume from")
    return ValueError(f"checkpoint {ckpt} is truncated or corrupt: {detail}. {hint}")


def write_step_json(path: str, obj: Any) -> None:
    atomic_write_json(path, obj, indent=1, fsync=True)


def read_step_json(path: str) -> Any:
    """A JSON file of a checkpoint; an unreadable one raises :func:`unreadable`'s error."""
    try:
        return read_json(path)
    except ValueError as e:
        raise unreadable(os.path.dirname(path).removesuffix(os.sep + "rng"), str(e)) from None


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- state dicts ------------------------------------------------------------------------------
def collect_tensors(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Collects the tensor leaves of a nested dict/list under dotted keys."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            collect_tensors(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            collect_tensors(v, f"{prefix}.{i}", out)


def model_config_dict(model: torch.nn.Module) -> dict[str, Any]:
    return json.loads(json.dumps(model.config.to_dict(), default=str))


def config_diff(saved: dict, current: dict) -> list[str]:
    keys = (set(saved) | set(current)) - _CONFIG_IGNORE
    return [
        f"{k}: checkpoint {saved.get(k, '<missing>')!r} vs run {current.get(k, '<missing>')!r}"
        for k in sorted(keys) if saved.get(k) != current.get(k)
    ]


def state_format(model: torch.nn.Module) -> str | None:
    """The model spec's marker of how the model holds its parameters (None: the plain one)."""
    try:
        fn = model_spec_for(model).hf.state_format
    except ValueError:  # not a registered model (e.g. a test stand-in)
        return None
    return fn(model) if fn is not None else None


def check_state_format(path: str, state: dict, model: torch.nn.Module) -> None:
    saved, current = state.get("state_format"), state_format(model)
    if saved != current:
        raise ValueError(
            f"refusing to load {path}: its parameters are laid out as "
            f"{saved or 'before layout markers (plain)'!r}, this version of hybridtrain holds "
            f"them as {current or 'plain'!r}; the tensors would load silently wrong. Export the "
            "checkpoint with the hybridtrain version that wrote it (`hybridtrain convert`) and "
            "start from that Hugging Face folder (model.local_dir)")
