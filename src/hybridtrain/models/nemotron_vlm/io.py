"""Saving and loading a vision-language model: the Nemotron-H safetensors writer (same
sharding, per-expert tensor names, the language model's Mamba rows in the Hub's order) and its
reader."""

from __future__ import annotations

import os
from collections import Counter

import torch

from hybridtrain.fileio import open_safetensors
from hybridtrain.models.nemotron_h.hf_io import (
    _ST_DTYPES,
    check_tensors,
    checkpoint_files,
    expected_hub_shapes,
    hub_layout,
    hub_name_to_ours,
    parse_dtype,
    read_checkpoint_header,
    save_hf_checkpoint,
)

from .config import NemotronVLMConfig


def load_vlm(cls, local_dir, dtype=None, device=None):
    local_dir = os.fspath(local_dir)
    if not os.path.isdir(local_dir):
        raise ValueError(f"{local_dir}: not a directory (from_pretrained takes a local folder)")
    config = NemotronVLMConfig.from_pretrained(local_dir)
    files = checkpoint_files(local_dir)
    found = read_checkpoint_header(files)
    with torch.device("meta"):
        model = cls(config)
    check_tensors(expected_hub_shapes(model.state_dict(keep_vars=True)), found, local_dir)
    counts = Counter(v[1] for v in found.values() if v[1] in _ST_DTYPES)
    stored = _ST_DTYPES[counts.most_common(1)[0][0]] if counts else torch.float32
    device = torch.device(device) if device is not None else torch.device("cpu")
    model.to(dtype=parse_dtype(dtype) or stored)
    model.to_empty(device=device)
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for path in files:
            with open_safetensors(path, device=str(device)) as f:
                for k in f.keys():
                    ours, expert = hub_name_to_ours(k)
                    target = state[ours] if expert is None else state[ours][expert]
                    target.copy_(hub_layout(ours, f.get_tensor(k), config.text_config, to_hub=False))
    model.checkpoint_dtype = stored
    return model.eval()


def save_vlm(state_dict, config: NemotronVLMConfig, out_dir, max_shard_size="5GB", dtype=None,
             tensors=None) -> None:
    """safetensors + config.json (see ``hf_io.save_hf_checkpoint``; ``tensors``: streamed)."""
    save_hf_checkpoint(state_dict, config, out_dir, max_shard_size=max_shard_size, dtype=dtype,
                       tensors=tensors, layout_config=config.text_config)
