"""The checkpointer: ``step_{N}/`` written atomically, a ``latest`` pointer, resume, retention.
Its files are :mod:`.checkpoint_files`; the HF export of a live model :mod:`.hf_export`; reading a
run from outside (convert, generate, evaluate, merge) :mod:`.checkpoint_reader`.

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

Readers (``convert``, ``generate``, ``evaluate``) go through
:func:`~.checkpoint_reader.read_checkpoint`: the step
a run folder's ``latest`` names, pinned while it is read; they write nothing into the run folder.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from hybridtrain.distributed.utils import barrier, get_rank, get_world_size
from hybridtrain.fileio import (
    WriteError, atomic_write, unique_tmp_path, write_error,
)
from hybridtrain.runfolder import STEP_RE, latest_checkpoint, unpinned
from hybridtrain.training.preemption import deferred_signals
from hybridtrain.training.checkpoint_files import (
    FINAL, LATEST, LOAD_OPTIONS, SAVE_OPTIONS, check_state_format, collect_tensors, config_diff,
    dcp_load, dcp_save, fsync_dir, model_config_dict, read_step_json, state_format, unreadable,
    write_step_json,
)
from hybridtrain.training.checkpoint_reader import read_checkpoint
from hybridtrain.training.dcp_safe import UnsafeCheckpointError, read_metadata
from hybridtrain.training.hf_export import default_export
from hybridtrain.training.rng import get_rng_state, set_rng_state


logger = logging.getLogger(__name__)


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


def _tensor_diff(path: str, model: torch.nn.Module) -> list[str]:
    """The tensors of ``model`` (not laid out yet; frozen ones aside, as :meth:`Checkpointer.save`
    writes them) that checkpoint ``path`` holds with another shape, or lacks."""
    try:
        saved = read_metadata(os.path.join(path, "dcp")).state_dict_metadata
    except UnsafeCheckpointError:
        raise
    except ValueError as e:
        raise unreadable(path, str(e)) from None
    out = []
    for name, tensor in get_model_state_dict(model, options=SAVE_OPTIONS).items():
        entry = saved.get(f"model.{name}")
        have = list(tensor.shape)
        if entry is None:
            out.append(f"tensor {name}: not in the checkpoint, this run {have}")
        elif list(entry.size) != have:
            out.append(f"tensor {name}: checkpoint {list(entry.size)}, this run {have}")
    return out


def check_resumable(path: str, model: torch.nn.Module, peft: dict | None,
                    tensors: bool = True) -> None:
    """Raises a ``ValueError`` saying why checkpoint ``path`` cannot continue a run of ``model``
    with the LoRA settings ``peft``: another model config, other LoRA settings and
    (``tensors``: ``model`` not laid out yet) tensors of other shapes, each named with both
    values. Called before the data is built."""
    state = read_step_json(os.path.join(path, "trainer_state.json"))
    reasons = []
    shapes = _tensor_diff(path, model) if tensors else []
    if shapes:
        more = f"\n  ... and {len(shapes) - 8} more" if len(shapes) > 8 else ""
        reasons.append("its tensors do not fit this run's model:\n  "
                       + "\n  ".join(shapes[:8]) + more)
    cfg_path, current = os.path.join(path, "config.json"), model_config_dict(model)
    diff = config_diff(read_step_json(cfg_path), current) if (
        current is not None and os.path.isfile(cfg_path)) else []
    if diff:
        reasons.append("its model config differs from this run's model config:\n  "
                       + "\n  ".join(diff))
    peft_diff = _peft_diff(state.get("peft"), peft)
    if peft_diff:
        reasons.append("its peft settings differ from this run's peft section:\n  "
                       + "\n  ".join(peft_diff))
    if reasons:
        raise ValueError(f"refusing to resume from {path}: " + ";\n".join(reasons)
                         + "\nUse the model and peft settings of the run that wrote it, a new "
                         "checkpoint.dir, or checkpoint.resume: null to start over")
    check_state_format(path, state, model)


def nothing_left(path: str, max_steps: int, num_epochs: float | None = None) -> str | None:
    """The one line that says a resume from checkpoint ``path`` has nothing to do (its step
    is at or past ``max_steps``, the recipe's or, given ``num_epochs``, that of its epochs), or
    None."""
    step = read_step_json(os.path.join(path, "trainer_state.json")).get("step")
    if not isinstance(step, int) or step < max_steps:
        return None
    if num_epochs is None:
        return (f"nothing to do: checkpoint step {step} >= training.max_steps {max_steps}; "
                "raise training.max_steps to train further")
    return (f"nothing to do: checkpoint step {step} >= the {max_steps} steps of "
            f"training.num_epochs {num_epochs}; raise training.num_epochs (or set "
            "training.max_steps) to train further")


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
            model_sd, optim_sd = get_state_dict(model, optimizer, options=SAVE_OPTIONS)
        else:  # nothing trainable on this rank: no optimizer state
            model_sd = get_model_state_dict(model, options=SAVE_OPTIONS)
            optim_sd = {"state": {}, "param_groups": []}
        tensors: dict[str, torch.Tensor] = {}
        collect_tensors(model_sd, "model", tensors)
        collect_tensors(optim_sd["state"], "optim.state", tensors)
        dcp_save(tensors, os.path.join(tmp, "dcp"))
        write_step_json(os.path.join(tmp, "rng", f"rank_{rank}.json"), get_rng_state())

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
                "state_format": state_format(model),
                **self.state_extra,
                "extra": extra or {},
            }
            write_step_json(os.path.join(tmp, "trainer_state.json"), json.loads(
                json.dumps(state, default=lambda o: o.item() if hasattr(o, "item") else str(o))))
            cfg = model_config_dict(model)
            if cfg is not None:
                write_step_json(os.path.join(tmp, "config.json"), cfg)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        if self.save_hf if export is None else export:
            self.export(model, tmp, final)
        barrier()

        if rank == 0:
            fsync_dir(tmp)
            if os.path.exists(out):  # re-saving a step (after a resume): replace it
                _discard(out)
            os.rename(tmp, out)
            fsync_dir(self.dir)
            atomic_write(os.path.join(self.dir, LATEST), name + "\n", fsync=True)
            fsync_dir(self.dir)
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
            raise unreadable(path, "it has no trainer_state.json")
        state = read_step_json(state_path)
        if check_config:
            check_resumable(path, model, self.state_extra.get("peft"), tensors=False)
        check_state_format(path, state, model)
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=SAVE_OPTIONS)
        else:
            model_sd, optim_sd = get_model_state_dict(model, options=SAVE_OPTIONS), None
        tensors: dict[str, torch.Tensor] = {}
        collect_tensors(model_sd, "model", tensors)
        if optim_sd is not None:
            collect_tensors(optim_sd["state"], "optim.state", tensors)
        dcp_load(tensors, os.path.join(path, "dcp"))  # in place
        if optim_sd is not None:
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=LOAD_OPTIONS)
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(model, model_sd, options=LOAD_OPTIONS)
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
        set_rng_state(read_step_json(rng_path))
        logger.info("resumed from %s (step %s)", path, state.get("step"))
        return state
