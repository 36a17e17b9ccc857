"""Reading a run's checkpoints without writing into its folder (``convert``, ``generate``,
``evaluate``, ``merge``, a resume): :func:`read_checkpoint` resolves the step (a run folder's
``latest``, a ``step_N``, an export inside one) and pins it while it is read, so a live run's
``keep_last`` leaves it until the reader is done; :func:`convert` writes a step as a Hugging Face
folder offline; :func:`load_checkpoint_model` builds the model a step holds."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
)

from hybridtrain.config import resolve_target
from hybridtrain.distributed.utils import get_rank, get_world_size, is_distributed
from hybridtrain.models.spec import model_spec_for, registered_model_class
from hybridtrain.peft.export import export_peft
from hybridtrain.peft.lora import apply_lora
from hybridtrain.runfolder import STEP_RE, latest_checkpoint, live_holder, pin_step
from hybridtrain.training.checkpoint_files import (
    LATEST, LOAD_OPTIONS, SAVE_OPTIONS, check_state_format, collect_tensors, dcp_load, read_step_json,
)
from hybridtrain.training.precision import resolve_save_dtype


logger = logging.getLogger(__name__)


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
    state = read_step_json(state_path)
    cls = _import_model_class(state.get("model_class"), state_path)
    cfg_cls = model_spec_for(cls).config_cls
    cfg = read_step_json(os.path.join(path, "config.json"))
    config = cfg_cls.from_dict(cfg, source=os.path.join(path, "config.json"))
    return path, state, cls, config


def _load_saved_tensors(model: torch.nn.Module, path: str, state: dict) -> None:
    """Fills the tensors the checkpoint at ``path`` holds (a LoRA run's: the adapters) into the
    whole, unsharded ``model``, in one process whatever layout wrote them."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    check_state_format(path, state, model)
    model_sd = get_model_state_dict(model, options=SAVE_OPTIONS)
    tensors: dict[str, torch.Tensor] = {}
    collect_tensors(model_sd, "model", tensors)
    dcp_load(tensors, os.path.join(path, "dcp"))
    set_model_state_dict(model, model_sd, options=LOAD_OPTIONS)


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
        check_state_format(path, state, model)
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
        dcp_load({f"model.{name}": t}, dcp_dir)
        yield name, t


def _copy_tokenizer(step_dir: str, out_dir: str) -> None:
    tok_dir = os.path.join(step_dir, "tokenizer")
    if os.path.isdir(tok_dir):
        for f in os.listdir(tok_dir):
            shutil.copy2(os.path.join(tok_dir, f), os.path.join(out_dir, f))
