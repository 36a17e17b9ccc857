"""The Hugging Face export of a live model (``hf/`` of a step, or a LoRA run's ``adapter/``):
full tensors streamed from however the model is sharded, written by its family's adapter."""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from hybridtrain.distributed.full_tensors import global_layout, stream_full_tensors
from hybridtrain.distributed.utils import barrier, get_rank
from hybridtrain.models.spec import model_spec_for



def save_pretrained_of(model, out_dir: str, state_dict: dict[str, torch.Tensor] | None,
                     dtype: torch.dtype | None = None) -> None:
    """``dtype``: the dtype to write (``checkpoint.save_dtype``; None: as held);
    ``state_dict``: gathered full tensors of a sharded model (None: the model's own)."""
    model.save_pretrained(out_dir, state_dict=state_dict, dtype=dtype)


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
            save_pretrained_of(model, out_dir, sd, dtype)
    if get_rank() == 0 and tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    barrier()


def default_export(model: torch.nn.Module, step_dir: str, tokenizer=None,
                   final: bool = False, dtype: torch.dtype | None = None) -> str:
    """The export written into a checkpoint: ``hf/`` (in ``dtype``). Collective."""
    out = os.path.join(step_dir, "hf")
    export_hf(model, out, tokenizer, dtype)
    return out
