"""Saving and loading a vision-language model: the Nemotron-H safetensors writer (same
sharding, per-expert tensor names, the language model's Mamba rows in the Hub's order) and its
reader."""

from __future__ import annotations

from hybridtrain.models.nemotron_h.hf_io import load_pretrained, save_hf_checkpoint, slice_reader

from .config import NemotronVLMConfig
from .omni import hub_name, is_omni_dir, save_omni


def _rename(local_dir):
    """Our tensor names -> the folder's: a transformers ``nemotron_h_omni`` folder names the
    ViT's and projector's tensors otherwise (:func:`.omni.hub_name`)."""
    return hub_name if is_omni_dir(local_dir) else (lambda name: name)


def load_vlm(cls, local_dir, dtype=None, device=None):
    """The Nemotron-H reader with the vision-language config (the language model's rows)."""
    return load_pretrained(cls, local_dir, dtype=dtype, device=device, config_cls=NemotronVLMConfig,
                           layout_config=lambda config: config.text_config,
                           rename=_rename(local_dir))


def vlm_slice_reader(local_dir):
    """The Nemotron-H slice reader (a meta-device model's weights read after its layout) with
    the vision-language config."""
    return slice_reader(local_dir, config_cls=NemotronVLMConfig,
                        layout_config=lambda config: config.text_config,
                        rename=_rename(local_dir))


def save_vlm(state_dict, config: NemotronVLMConfig, out_dir, max_shard_size="5GB", dtype=None,
             tensors=None) -> None:
    """safetensors + config.json (see ``hf_io.save_hf_checkpoint``; ``tensors``: streamed); a
    model read from a ``nemotron_h_omni`` folder is written in that layout."""
    if config.hf_omni_config is not None:
        return save_omni(state_dict, config, out_dir, max_shard_size=max_shard_size, dtype=dtype,
                         tensors=tensors)
    save_hf_checkpoint(state_dict, config, out_dir, max_shard_size=max_shard_size, dtype=dtype,
                       tensors=tensors, layout_config=config.text_config)
