"""Checkpoints: ``step_{N}/`` written atomically, a ``latest`` pointer, resume, retention, HF export.

Layout of ``<checkpoint.dir>/step_{N}/``::

    dcp/                  torch.distributed.checkpoint of every *tensor* of the model and
                          optimizer state (sharded on N ranks, one file set in one process)
    trainer_state.json    step scheduler (step, epoch, consumed samples, data position),
                          LR scheduler, optimizer hyper-parameters (for reading), world size
    rng/rank_{r}.json     python / numpy / torch CPU / CUDA RNG states of each rank
    config.json           the model config (resume refuses a different one)
    tokenizer/            tokenizer files (for ``convert``)
    hf/                   consolidated Hugging Face export (the final checkpoint, or each one
                          with ``save_hf``); LoRA runs write ``adapter/`` (PEFT format) instead

Only tensors go through DCP (its non-tensor path unpickles); everything else is JSON. Optimizer
hyper-parameters come from the run's config on resume and the LR from the LR scheduler.

A checkpoint is written into ``.step_{N}.tmp`` and renamed to ``step_{N}`` when complete; the
``latest`` file (``step_{N}``) is then replaced atomically. A crash at any point leaves the
previous checkpoint and ``latest`` untouched. Signals that arrive during a save wait until it is
complete (:func:`~hybridtrain.training.preemption.deferred_signals`). A step folder leaves
(``keep_last``, a re-save, ``clear``) by a rename to ``.step_{N}.old`` before it is deleted, and
a step a reader has pinned (:func:`~hybridtrain.runfolder.pin_step`) stays until a later save.

Readers (``convert``, ``generate``, ``evaluate``) go through :func:`read_checkpoint`: the step
a run folder's ``latest`` names, pinned while it is read; they write nothing into the run folder.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from hybridtrain.config import resolve_target
from hybridtrain.distributed.full_tensors import global_layout, stream_full_tensors
from hybridtrain.distributed.utils import barrier, get_rank, get_world_size, is_distributed
from hybridtrain.fileio import (
    WriteError, atomic_write, atomic_write_json, read_json, unique_tmp_path, write_error,
)
from hybridtrain.models.spec import model_spec_for, registered_model_class
from hybridtrain.peft.export import export_peft
from hybridtrain.peft.lora import apply_lora
from hybridtrain.runfolder import STEP_RE, latest_checkpoint, live_holder, pin_step, unpinned
from hybridtrain.training.preemption import deferred_signals
from hybridtrain.training.dcp_safe import (SafeFileSystemReader, UnsafeCheckpointError,
                                           read_metadata)
from hybridtrain.training.precision import resolve_save_dtype
from hybridtrain.training.rng import get_rng_state, set_rng_state

logger = logging.getLogger(__name__)

LATEST = "latest"
FINAL = "final"  # symlink to the step folder holding the finished run's export
# Config keys that do not change the model's function; ignored when comparing on resume.
_CONFIG_IGNORE = {
    "transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures", "auto_map",
    "_attn_implementation", "_attn_implementation_autoset", "_attn_implementation_internal",
    "use_cache", "output_hidden_states", "output_attentions", "return_dict", "_commit_hash",
}
# Frozen parameters (a LoRA run's base weights) are not saved: they come from the base model.
_SD_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Loading fills the templates taken with _SD_OPTIONS (DCP itself fails on a missing key), so
# the frozen parameters absent from them are expected.
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


# -- files ------------------------------------------------------------------------------------
def _dcp_save(tensors: dict[str, torch.Tensor], path: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        dcp.save(tensors, checkpoint_id=path, no_dist=not is_distributed())


def _dcp_load(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Loads in place into ``tensors`` (plain or DTensor, resharding as needed); the index is
    read as data (:mod:`hybridtrain.training.dcp_safe`: a ``.metadata`` that names code is
    refused). An unreadable shard or metadata file raises :func:`_unreadable`'s error."""
    try:
        read_metadata(path)  # checked up front: a clear error, before torch logs its own
    except UnsafeCheckpointError:
        raise
    except ValueError as e:
        raise _unreadable(os.path.dirname(path), str(e)) from None
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
            detail = "; ".join(map(_describe, causes))
            raise _unreadable(os.path.dirname(path), f"{path} cannot be read ({detail})") from e


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def _previous_checkpoint(ckpt: str) -> str | None:
    """The newest complete ``step_M`` (M < N) beside the checkpoint ``.../step_N``."""
    run_dir, name = os.path.split(os.path.abspath(ckpt))
    m = STEP_RE.match(name)
    if m is None or not os.path.isdir(run_dir):
        return None
    older = [int(k.group(1)) for k in map(STEP_RE.match, os.listdir(run_dir))
             if k and int(k.group(1)) < int(m.group(1))
             and os.path.isfile(os.path.join(run_dir, k.group(0), "trainer_state.json"))]
    return os.path.join(run_dir, f"step_{max(older)}") if older else None


def _unreadable(ckpt: str, detail: str) -> ValueError:
    """The error of a checkpoint that cannot be read: names it and the previous one."""
    prev = _previous_checkpoint(ckpt)
    hint = (f"Resume from the previous checkpoint instead: --checkpoint.resume={prev}" if prev
            else "There is no earlier checkpoint beside it to resume from")
    return ValueError(f"checkpoint {ckpt} is truncated or corrupt: {detail}. {hint}")


def _write_json(path: str, obj: Any) -> None:
    atomic_write_json(path, obj, indent=1, fsync=True)


def _read_json(path: str) -> Any:
    """A JSON file of a checkpoint; an unreadable one raises :func:`_unreadable`'s error."""
    try:
        return read_json(path)
    except ValueError as e:
        raise _unreadable(os.path.dirname(path).removesuffix(os.sep + "rng"), str(e)) from None


def _fsync_dir(path: str) -> None:
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
def _tensors(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Collects the tensor leaves of a nested dict/list under dotted keys."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(v, f"{prefix}.{i}", out)


def model_config_dict(model: torch.nn.Module) -> dict[str, Any]:
    return json.loads(json.dumps(model.config.to_dict(), default=str))


def _config_diff(saved: dict, current: dict) -> list[str]:
    keys = (set(saved) | set(current)) - _CONFIG_IGNORE
    return [
        f"{k}: checkpoint {saved.get(k, '<missing>')!r} vs run {current.get(k, '<missing>')!r}"
        for k in sorted(keys) if saved.get(k) != current.get(k)
    ]


def _save_pretrained(model, out_dir: str, state_dict: dict[str, torch.Tensor] | None,
                     dtype: torch.dtype | None = None) -> None:
    """``dtype``: the dtype to write (``checkpoint.save_dtype``; None: as held);
    ``state_dict``: gathered full tensors of a sharded model (None: the model's own)."""
    model.save_pretrained(out_dir, state_dict=state_dict, dtype=dtype)


def _state_format(model: torch.nn.Module) -> str | None:
    """The model spec's marker of how the model holds its parameters (None: the plain one)."""
    try:
        fn = model_spec_for(model).hf.state_format
    except ValueError:  # not a registered model (e.g. a test stand-in)
        return None
    return fn(model) if fn is not None else None


def _check_state_format(path: str, state: dict, model: torch.nn.Module) -> None:
    saved, current = state.get("state_format"), _state_format(model)
    if saved != current:
        raise ValueError(
            f"refusing to load {path}: its parameters are laid out as "
            f"{saved or 'before layout markers (plain)'!r}, this version of hybridtrain holds "
            f"them as {current or 'plain'!r}; the tensors would load silently wrong. Export the "
            "checkpoint with the hybridtrain version that wrote it (`hybridtrain convert`) and "
            "start from that Hugging Face folder (model.local_dir)")


def export_hf(model: torch.nn.Module, out_dir: str, tokenizer=None,
              dtype: torch.dtype | None = None) -> None:
    """Consolidated Hugging Face export: rank 0 writes ``config.json``, safetensors and the
    tokenizer. A sharded model (FSDP, expert slices, pipeline stages) is streamed tensor by
    tensor: the ranks holding each tensor gather it in turn (another stage's rank sends it to
    rank 0), and rank 0 holds at most one output file's tensors, never the model. Collective:
    call on every rank."""
    try:
        spec = model_spec_for(model)
    except ValueError:  # not a registered model (e.g. a test stand-in)
        spec = None
    sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
    if spec is not None and (sharded or not spec.pipeline.is_complete(model)):
        layout = global_layout(model)
        stream = stream_full_tensors(model, layout)
        if get_rank() == 0:
            os.makedirs(out_dir, exist_ok=True)
            spec.hf.save(layout, model.config, out_dir, dtype=dtype, tensors=stream)
        for _ in stream:  # the other ranks' part (and the end of rank 0's)
            pass
    else:
        sd = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True)) if sharded else None
        if get_rank() == 0:
            os.makedirs(out_dir, exist_ok=True)
            _save_pretrained(model, out_dir, sd, dtype)
    if get_rank() == 0 and tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    barrier()


def default_export(model: torch.nn.Module, step_dir: str, tokenizer=None,
                   final: bool = False, dtype: torch.dtype | None = None) -> str:
    """The export written into a checkpoint: ``hf/`` (in ``dtype``). Collective."""
    out = os.path.join(step_dir, "hf")
    export_hf(model, out, tokenizer, dtype)
    return out


def _partial_dir(run_dir: str, step: int) -> str:
    """Where ``step_{step}`` is written before it is complete."""
    return os.path.join(run_dir, f".step_{step}.tmp")


def _discard(path: str) -> None:
    """Deletes the step folder ``path``: renamed to ``.step_N.old`` first, so that it leaves at
    once for a reader (a half-deleted step is never seen under its name)."""
    old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old")
    shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(path, old)
    except FileNotFoundError:
        return
    shutil.rmtree(old, ignore_errors=True)


def _under_deferred_signals(write: Callable) -> Callable:
    """A writing method of the run folder that signals do not cut short (they are handled once
    it is done)."""
    @functools.wraps(write)
    def wrapper(*args, **kwargs):
        with deferred_signals():
            return write(*args, **kwargs)
    return wrapper


def _removes_partial_on_write_error(save: Callable) -> Callable:
    """``Checkpointer.save`` that, when a disk is full or read-only, removes the partial
    checkpoint (it would fill the disk further) and raises a ``WriteError`` naming the path."""
    @functools.wraps(save)
    def wrapper(self, step: int, *args, **kwargs):
        try:
            return save(self, step, *args, **kwargs)
        except (OSError, WriteError, dcp.CheckpointException) as e:
            causes = [c for c, _ in e.failures.values()] if hasattr(e, "failures") else [e]
            tmp = _partial_dir(self.dir, step)
            what = f"checkpoint {os.path.join(self.dir, f'step_{step}')}"
            err = next(filter(None, (write_error(c, what, tmp) for c in causes)), None)
            if err is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise type(err)(f"{err}; the partial checkpoint was removed") from e
    return wrapper


# -- the checkpointer -------------------------------------------------------------------------
def _peft_diff(saved: dict | None, current: dict | None) -> list[str]:
    """Differences between the LoRA settings of a checkpoint and of this run (dropout ignored:
    it does not change the adapters); a LoRA checkpoint vs a full one is a difference too."""
    saved, current = json.loads(json.dumps(saved)), json.loads(json.dumps(current))
    if not saved and not current:
        return []
    if not saved or not current:
        return [f"peft: checkpoint {'has' if saved else 'has no'} adapters, this run "
                f"{'has' if current else 'has no'} peft section"]
    keys = (set(saved) | set(current)) - {"dropout"}
    return [f"peft.{k}: checkpoint {saved.get(k)!r}, this run {current.get(k)!r}"
            for k in sorted(keys) if saved.get(k) != current.get(k)]


class Checkpointer:
    """Saves and restores training state under ``dir`` (see module docstring).

    ``keep_last``: keep the newest K ``step_*`` folders (never the one ``latest`` names);
    ``save_hf``: write the export into every checkpoint (otherwise only when ``save(...,
    export=True)``, which the trainer does for the final one). ``export_fn(model, step_dir,
    tokenizer, final)`` writes the export (default: ``hf/``; LoRA: ``adapter/``).
    ``state_extra`` is stored in ``trainer_state.json`` (e.g. the LoRA settings, for ``convert``).
    ``tokenizer``: saved into every checkpoint (``tokenizer/``) and its export.
    """

    def __init__(self, dir: str, keep_last: int | None = None, save_hf: bool = False,
                 export_fn: Callable | None = None, state_extra: dict | None = None,
                 tokenizer=None):
        self.dir = os.path.abspath(dir)
        self.tokenizer = tokenizer
        self.keep_last = keep_last
        self.save_hf = save_hf
        self.export_fn = export_fn or default_export
        self.state_extra = dict(state_extra or {})
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1 or null, got {keep_last}")
        # Nothing is written here: a reader makes one too. What a dead writer left is removed
        # by the run that takes the folder's lock (hybridtrain.runfolder.RunLock).

    # -- discovery ---------------------------------------------------------------------------
    def latest(self) -> str | None:
        """The folder ``latest`` names, or None."""
        return latest_checkpoint(self.dir)

    def steps(self) -> list[int]:
        out = []
        for name in os.listdir(self.dir) if os.path.isdir(self.dir) else []:
            m = STEP_RE.match(name)
            if m and os.path.isdir(os.path.join(self.dir, name)):
                out.append(int(m.group(1)))
        return sorted(out)

    def resolve_resume(self, resume: str | bool | None) -> str | None:
        """``auto`` -> ``latest`` if present; a path -> that checkpoint (a run folder means its
        ``latest``); ``None``/``false`` -> None."""
        if resume in (None, False, "", "none", "null"):
            return None
        if resume in ("auto", True):
            return self.latest()
        path = os.path.abspath(str(resume))
        if os.path.isfile(os.path.join(path, LATEST)):
            return latest_checkpoint(path)
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            raise ValueError(
                f"checkpoint.resume={resume!r}: {path} is not a checkpoint folder (no "
                "trainer_state.json) nor a run folder with a 'latest' file"
            )
        return path

    # -- save --------------------------------------------------------------------------------
    @_under_deferred_signals
    @_removes_partial_on_write_error
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler=None,
        step_scheduler=None,
        extra: dict[str, Any] | None = None,
        export: bool | None = None,
        final: bool = False,
    ) -> str:
        """Writes ``step_{step}``; collective (every rank calls it). Returns the folder.
        ``export``: write the HF / adapter export into it (default: ``save_hf``); ``final``:
        this is the run's last checkpoint (handed to ``export_fn``)."""
        t0 = time.perf_counter()
        name = f"step_{step}"
        out = os.path.join(self.dir, name)
        tmp = _partial_dir(self.dir, step)
        rank = get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))  # and the run folder
        barrier()

        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=_SD_OPTIONS)
        else:  # nothing trainable on this rank: no optimizer state
            model_sd = get_model_state_dict(model, options=_SD_OPTIONS)
            optim_sd = {"state": {}, "param_groups": []}
        tensors: dict[str, torch.Tensor] = {}
        _tensors(model_sd, "model", tensors)
        _tensors(optim_sd["state"], "optim.state", tensors)
        _dcp_save(tensors, os.path.join(tmp, "dcp"))
        _write_json(os.path.join(tmp, "rng", f"rank_{rank}.json"), get_rng_state())

        if rank == 0:
            state = {
                "step": step,
                "world_size": get_world_size(),
                "step_scheduler": step_scheduler.state_dict() if step_scheduler else None,
                "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler else None,
                "optimizer_hparams": [
                    {k: v for k, v in g.items() if k != "params"}
                    for g in optim_sd.get("param_groups", [])
                ],
                "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
                "state_format": _state_format(model),
                **self.state_extra,
                "extra": extra or {},
            }
            _write_json(os.path.join(tmp, "trainer_state.json"), json.loads(
                json.dumps(state, default=lambda o: o.item() if hasattr(o, "item") else str(o))))
            cfg = model_config_dict(model)
            if cfg is not None:
                _write_json(os.path.join(tmp, "config.json"), cfg)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        if self.save_hf if export is None else export:
            self.export(model, tmp, final)
        barrier()

        if rank == 0:
            _fsync_dir(tmp)
            if os.path.exists(out):  # re-saving a step (after a resume): replace it
                _discard(out)
            os.rename(tmp, out)
            _fsync_dir(self.dir)
            atomic_write(os.path.join(self.dir, LATEST), name + "\n", fsync=True)
            _fsync_dir(self.dir)
            self._retain(name)
            logger.info("saved checkpoint %s in %.1fs", out, time.perf_counter() - t0)
        barrier()
        return out

    @_under_deferred_signals
    def export(self, model: torch.nn.Module, out_dir: str, final: bool = True) -> None:
        """Writes the export (``export_fn``: ``hf/``, or ``adapter/`` for LoRA) into ``out_dir``.
        Collective."""
        self.export_fn(model, out_dir, self.tokenizer, final)

    @_under_deferred_signals
    def set_latest(self, step: int) -> str:
        """Points ``latest`` at the existing ``step_{step}`` (a resume goes back there);
        collective. Returns the folder."""
        name = f"step_{step}"
        assert step in self.steps(), f"no checkpoint {name} in {self.dir}"
        if get_rank() == 0:
            atomic_write(os.path.join(self.dir, LATEST), name + "\n", fsync=True)
        barrier()
        return os.path.join(self.dir, name)

    @_under_deferred_signals
    def mark_final(self, export_dir: str) -> str:
        """Points the symlink ``final`` at ``export_dir`` (a ``step_N`` folder or the run folder
        itself): ``final/hf`` (``final/adapter``) is the finished run's export whatever its step
        count; collective. Returns the link's path."""
        link = os.path.join(self.dir, FINAL)
        if get_rank() == 0:
            target = os.path.relpath(os.path.abspath(export_dir), self.dir)
            tmp = unique_tmp_path(link)
            os.symlink(target, tmp, target_is_directory=True)
            os.replace(tmp, link)
            latest = self.latest()
            if latest is not None:  # the step `final` named before may go now
                self._retain(os.path.basename(latest))
        barrier()
        return link

    @_under_deferred_signals
    def clear(self) -> list[str]:
        """Removes the ``step_*`` folders and ``latest`` of an earlier run in ``dir`` (a new run
        starts there); collective. Returns the removed names."""
        names = [f"step_{s}" for s in self.steps()]
        for pointer in (LATEST, FINAL):
            if os.path.lexists(os.path.join(self.dir, pointer)):
                names.append(pointer)
        barrier()
        if get_rank() == 0:
            for n in names:
                p = os.path.join(self.dir, n)
                _discard(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
        barrier()
        return names

    def _retain(self, latest_name: str) -> None:
        if not self.keep_last:
            return
        steps = self.steps()
        final = os.path.basename(os.path.realpath(os.path.join(self.dir, FINAL)))
        for s in steps[: max(len(steps) - self.keep_last, 0)]:
            if f"step_{s}" in (latest_name, final):
                continue
            path = os.path.join(self.dir, f"step_{s}")
            with unpinned(path) as free:
                if free:
                    try:
                        _discard(path)
                    except OSError as e:  # the new checkpoint is saved: not a failed save
                        logger.warning("could not remove the old checkpoint %s: %s", path, e)
            if not free:
                logger.info("keeping %s until a later save: a reader is reading it", path)

    # -- load --------------------------------------------------------------------------------
    def load(
        self,
        path: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler=None,
        step_scheduler=None,
        check_config: bool = True,
    ) -> dict[str, Any]:
        """Restores everything :meth:`save` wrote from ``path``; collective. Returns the
        trainer state dict. ``path`` is read as :func:`read_checkpoint` reads it (pinned: the
        checkpoint of another, live run too)."""
        return read_checkpoint(path, lambda step: self._load(
            step, model, optimizer, lr_scheduler, step_scheduler, check_config))

    def _load(self, path: str, model: torch.nn.Module, optimizer, lr_scheduler, step_scheduler,
              check_config: bool) -> dict[str, Any]:
        state_path = os.path.join(path, "trainer_state.json")
        if not os.path.isfile(state_path):
            raise _unreadable(path, "it has no trainer_state.json")
        state = _read_json(state_path)
        cfg_path = os.path.join(path, "config.json")
        current = model_config_dict(model)
        if check_config and current is not None and os.path.isfile(cfg_path):
            diff = _config_diff(_read_json(cfg_path), current)
            if diff:
                raise ValueError(
                    f"refusing to resume from {path}: its model config differs from this run's "
                    f"model config:\n  " + "\n  ".join(diff) + "\nUse the same model config, a "
                    "new checkpoint.dir, or checkpoint.resume: null to start over"
                )
        if check_config:
            peft_diff = _peft_diff(state.get("peft"), self.state_extra.get("peft"))
            if peft_diff:
                raise ValueError(
                    f"refusing to resume from {path}: its peft settings differ from this run's "
                    f"peft section:\n  " + "\n  ".join(peft_diff) + "\nUse the same peft "
                    "settings, a new checkpoint.dir, or checkpoint.resume: null to start over")
        _check_state_format(path, state, model)
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=_SD_OPTIONS)
        else:
            model_sd, optim_sd = get_model_state_dict(model, options=_SD_OPTIONS), None
        tensors: dict[str, torch.Tensor] = {}
        _tensors(model_sd, "model", tensors)
        if optim_sd is not None:
            _tensors(optim_sd["state"], "optim.state", tensors)
        _dcp_load(tensors, os.path.join(path, "dcp"))  # in place
        if optim_sd is not None:
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=_LOAD_OPTIONS)
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(model, model_sd, options=_LOAD_OPTIONS)
        if step_scheduler is not None and state.get("step_scheduler") is not None:
            step_scheduler.load_state_dict(state["step_scheduler"])
        if lr_scheduler is not None and state.get("lr_scheduler") is not None:
            lr_scheduler.load_state_dict(state["lr_scheduler"])
        rank = get_rank()
        rng_path = os.path.join(path, "rng", f"rank_{rank}.json")
        if not os.path.isfile(rng_path):
            logger.warning("checkpoint has no RNG state for rank %d (saved on %s ranks); using "
                           "rank 0's", rank, state.get("world_size"))
            rng_path = os.path.join(path, "rng", "rank_0.json")
        set_rng_state(_read_json(rng_path))
        logger.info("resumed from %s (step %s)", path, state.get("step"))
        return state


# -- convert ----------------------------------------------------------------------------------
def _import_model_class(dotted: Any, state_path: str) -> type:
    """The model class a checkpoint's ``trainer_state.json`` names: a registered spec's, or a
    public ``hybridtrain.models`` subclass of one (resolved like a recipe's ``_target_``);
    nothing else is imported."""
    try:
        return registered_model_class(dotted)
    except ValueError as e:
        why = str(e)
    if isinstance(dotted, str) and dotted.startswith("hybridtrain.models."):
        try:
            cls = resolve_target(dotted, ("hybridtrain.models.",))
            if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
                model_spec_for(cls)
                return cls
        except (ValueError, ImportError):
            pass
    raise ValueError(f"{state_path}: 'model_class': {why}. The file was edited, or the run's "
                     "model family is not registered in this program; restore 'model_class' to "
                     "the class the run trained (module.Class)")


def step_folder(path: str) -> str:
    """The absolute ``step_N`` folder ``path`` names: itself, or a run folder's ``latest``."""
    path = os.path.abspath(path)
    return latest_checkpoint(path) if os.path.isfile(os.path.join(path, LATEST)) else path


READ_TRIES = 5  # steps a reader tries when a live run removes each one while it is read


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (itself in one process)."""
    if not is_distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _all(flag: bool) -> bool:
    """True when ``flag`` is True on every rank."""
    if not is_distributed():
        return flag
    flags = [None] * get_world_size()
    torch.distributed.all_gather_object(flags, bool(flag))
    return all(flags)


def read_checkpoint(path: str, read: Callable[[str], Any]) -> Any:
    """``read(step)`` of the checkpoint ``path`` names: itself (a ``step_N`` folder, its
    export, or any other folder), or, for a run folder, the step its ``latest`` names.
    Read-only: the step is pinned (:func:`~hybridtrain.runfolder.pin_step`) while ``read``
    runs, so a live run's ``keep_last`` rotation leaves it alone. Where it is removed all the
    same (a file system without locks, a re-save of the step) the read of a run folder goes on
    with its newest step; a ``step_N`` the user named is reported as removed by the run.
    Collective in a process group (rank 0 chooses the step, every rank pins it)."""
    path = os.path.abspath(path)
    run_dir = path if os.path.isfile(os.path.join(path, LATEST)) else None
    tried: list[str] = []
    while True:
        choice = None
        if get_rank() == 0:
            try:
                choice = ("step", _newest(run_dir, tried) if run_dir else path)
            except ValueError as e:
                choice = ("error", str(e))
        kind, step = _broadcast(choice)
        if kind == "error":
            raise ValueError(step)
        before, pin, gone = _identity(step), None, False
        try:
            pin = pin_step(_step_of_path(step))
        except FileNotFoundError:  # not a checkpoint (read() says so), or rotated away just now
            gone = before is not None and _identity(step) != before
        if not _all(not gone):
            _unpin(pin)
            tried.append(step)
            if run_dir is None:
                raise _removed(step, path)
            continue
        try:
            out = read(step)
        except Exception:
            if before is None or _identity(step) == before:
                raise  # the step is still there as it was: its own error stands
            tried.append(step)
            if run_dir is None or is_distributed():
                raise _removed(step, path) from None
            logger.warning("%s was removed by the run writing %s while it was being read; "
                           "reading its newest checkpoint instead", step, run_dir)
            continue
        finally:
            _unpin(pin)
        if before is not None and _identity(step) != before:  # replaced while it was read
            tried.append(step)
            if run_dir is None or is_distributed():
                raise _removed(step, path)
            continue
        return out


def _step_of_path(path: str) -> str:
    """The checkpoint to pin for ``path``: itself, or the ``step_N`` folder it lies in (its
    ``hf/`` or ``adapter/`` export)."""
    parent = os.path.dirname(path)
    if not os.path.isfile(os.path.join(path, "trainer_state.json")) and \
            STEP_RE.match(os.path.basename(parent)) and \
            os.path.isfile(os.path.join(parent, "trainer_state.json")):
        return parent
    return path


def _unpin(pin: int | None) -> None:
    if pin is not None:
        os.close(pin)


def _newest(run_dir: str, tried: list[str]) -> str:
    """The step ``latest`` of ``run_dir`` names now; an error naming the live run after
    :data:`READ_TRIES` steps it removed while they were read."""
    if len(tried) >= READ_TRIES:
        holder = live_holder(run_dir)
        raise ValueError(
            f"{run_dir}: " + (f"a live run holds this folder ({holder}) and" if holder else
                              "the run writing this folder")
            + f" removed each of its last {len(tried)} checkpoints while it was being read "
            f"(the last {os.path.basename(tried[-1])}): its checkpoint.keep_last rotation "
            "outpaces this read on a file system without file locks. Read it once the run has "
            "ended, or give the run a larger checkpoint.keep_last")
    for attempt in range(50):  # `latest` may name a step being rotated away right now
        try:
            step = latest_checkpoint(run_dir)
        except ValueError:
            if attempt == 49 or live_holder(run_dir) is None:
                raise
            time.sleep(0.02)
            continue
        if step is None:
            raise ValueError(f"{run_dir} holds no checkpoint (no 'latest' file)")
        return step


def _removed(step: str, asked: str) -> ValueError:
    """The error of a step removed while it was read (never "truncated or corrupt")."""
    run_dir = os.path.dirname(step)
    holder = live_holder(run_dir)
    who = (f"a live run holds this folder ({holder}) and removed it (its "
           "checkpoint.keep_last rotation or a re-save)" if holder else
           "it was removed or replaced meanwhile")
    return ValueError(f"{asked}: checkpoint {step} went away while it was being read: {who}. "
                      f"Read the run folder {run_dir} (its newest checkpoint), or a step it keeps")


def _open_checkpoint(ckpt_dir: str) -> tuple[str, dict, type, Any]:
    """(step folder, trainer state, model class, model config) of a ``step_N`` folder or a run
    folder (its ``latest``)."""
    path = step_folder(ckpt_dir)
    state_path = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state_path):
        raise ValueError(f"{ckpt_dir} is not a checkpoint (no trainer_state.json) nor a run "
                         "folder with a 'latest' file")
    state = _read_json(state_path)
    cls = _import_model_class(state.get("model_class"), state_path)
    cfg_cls = model_spec_for(cls).config_cls
    cfg = _read_json(os.path.join(path, "config.json"))
    config = cfg_cls.from_dict(cfg, source=os.path.join(path, "config.json"))
    return path, state, cls, config


def _load_saved_tensors(model: torch.nn.Module, path: str, state: dict) -> None:
    """Fills the tensors the checkpoint at ``path`` holds (a LoRA run's: the adapters) into the
    whole, unsharded ``model``, in one process whatever layout wrote them."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    _check_state_format(path, state, model)
    model_sd = get_model_state_dict(model, options=_SD_OPTIONS)
    tensors: dict[str, torch.Tensor] = {}
    _tensors(model_sd, "model", tensors)
    _dcp_load(tensors, os.path.join(path, "dcp"))
    set_model_state_dict(model, model_sd, options=_LOAD_OPTIONS)


def convert(ckpt_dir: str, out_hf_dir: str, dtype: str | torch.dtype | None = None) -> str:
    """Exports a checkpoint (``step_N`` folder, or a run folder -> its ``latest``) as a
    consolidated Hugging Face folder (a LoRA run's: a PEFT adapter folder), with the tokenizer.
    Works in one process whatever parallel layout wrote the checkpoint; reads it as
    :func:`read_checkpoint` does (a live run's folder too)."""
    return read_checkpoint(ckpt_dir, lambda step: _convert(step, out_hf_dir, dtype))


def _convert(ckpt_dir: str, out_hf_dir: str, dtype: str | torch.dtype | None) -> str:
    path, state, cls, config = _open_checkpoint(ckpt_dir)
    peft = state.get("peft")
    if not peft:  # the HF export, read and written one tensor at a time
        with torch.device("meta"):
            model = cls(config)
        _check_state_format(path, state, model)
        os.makedirs(out_hf_dir, exist_ok=True)
        model_spec_for(cls).hf.save(model.state_dict(), config, out_hf_dir,
                                    dtype=resolve_save_dtype(dtype, model),
                                    tensors=_dcp_tensors(model.state_dict(),
                                                         os.path.join(path, "dcp")))
        _copy_tokenizer(path, out_hf_dir)
        logger.info("exported %s to %s", path, out_hf_dir)
        return out_hf_dir
    # a LoRA checkpoint holds the adapters only: export them in PEFT format
    model = cls(config)  # real init: non-persistent buffers (e.g. rotary) must be valid
    apply_lora(model, **peft)
    _load_saved_tensors(model, path, state)
    os.makedirs(out_hf_dir, exist_ok=True)
    export_peft(model, out_hf_dir, state.get("base_model_name_or_path"))
    _copy_tokenizer(path, out_hf_dir)
    logger.info("exported %s to %s", path, out_hf_dir)
    return out_hf_dir


def load_checkpoint_model(ckpt_dir: str) -> tuple[torch.nn.Module, str]:
    """(model, step folder): the model a checkpoint (``step_N`` or a run folder's ``latest``)
    holds, whole, in one process, its ``dcp/`` read as :func:`convert` reads it whatever layout
    wrote it; a LoRA checkpoint's adapters on the base model it records (a Hugging Face folder,
    relative to the working directory as in training). For a step without an export; reads it
    as :func:`read_checkpoint` does."""
    return read_checkpoint(ckpt_dir, _load_checkpoint_model)


def _load_checkpoint_model(ckpt_dir: str) -> tuple[torch.nn.Module, str]:
    path, state, cls, config = _open_checkpoint(ckpt_dir)
    peft = state.get("peft")
    if peft:
        base = state.get("base_model_name_or_path")
        if not base or not os.path.isfile(os.path.join(base, "config.json")):
            raise ValueError(f"{path} is a LoRA checkpoint whose base model ({base!r}) is not a "
                             "Hugging Face folder here; run from the training's working directory "
                             f"or export the adapters with `hybridtrain convert {path} OUT_DIR`")
        model = cls.from_pretrained(base)
        apply_lora(model, **peft)
    else:
        model = cls(config)  # real init: non-persistent buffers (e.g. rotary) must be valid
    _load_saved_tensors(model, path, state)
    return model, path


def _dcp_tensors(layout: dict[str, torch.Tensor], dcp_dir: str):
    """``(name, tensor)`` of each of ``layout``'s names (meta tensors give shape and dtype)
    read from the checkpoint's ``dcp/`` one at a time."""
    for name, meta in layout.items():
        t = torch.empty(meta.shape, dtype=meta.dtype)
        _dcp_load({f"model.{name}": t}, dcp_dir)
        yield name, t


def _copy_tokenizer(step_dir: str, out_dir: str) -> None:
    tok_dir = os.path.join(step_dir, "tokenizer")
    if os.path.isdir(tok_dir):
        for f in os.listdir(tok_dir):
            shutil.copy2(os.path.join(tok_dir, f), os.path.join(out_dir, f))
