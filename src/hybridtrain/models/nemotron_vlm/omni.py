"""transformers' ``nemotron_h_omni`` checkpoints (``NemotronH_Omni_Reasoning_V3``: the RADIO
vision encoder, a pixel-shuffle + MLP projector, the Nemotron-H language model) read into
:class:`NemotronVLMForConditionalGeneration` and written back in the same layout.

The folder's ``config.json`` becomes a :class:`NemotronVLMConfig` (legacy field names of the
released checkpoints included: ``llm_config``, ``vit_hidden_size``, ``img_context_token_id``...)
that keeps the original dict, which an export writes back unchanged. Tensor names: the language
model's are ours under ``language_model.``; the ViT's and the projector's map by :data:`_TO_HUB`
(RADIO's fused ``qkv`` is ours). The video patch projection and RADIO's summary indices are
carried as frozen buffers, and so is an audio encoder (``audio_config`` / ``sound_config``):
loaded, never run or trained, written back unchanged (in the export's dtype).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hybridtrain.fileio import read_json
from hybridtrain.models.nemotron_h.config import NemotronHConfig
from hybridtrain.models.nemotron_h.hf_io import (
    checkpoint_files, read_checkpoint_header, save_hf_checkpoint)

from .config import OMNI_MODEL_TYPE, NemotronVLMConfig, VisionConfig

# released checkpoints' names -> transformers' (as NemotronH_Omni_Reasoning_V3_Config maps them)
LEGACY_FIELDS = {"img_context_token_id": "image_token_id", "llm_config": "text_config",
                 "vit_hidden_size": "vision_hidden_size", "sound_config": "audio_config",
                 "video_context_token_id": "video_token_id",
                 "sound_context_token_id": "audio_token_id"}
_RADIO = "vision_model.radio_model."
_BLOCK = _RADIO + r"model.blocks.\1."
# our name -> the checkpoint's (first match); the language model's names are the same
_TO_HUB = [
    (r"^vision_model\.blocks\.(\d+)\.(fc[12])\.", _BLOCK + r"mlp.\2."),
    (r"^vision_model\.blocks\.(\d+)\.layer_scale([12])$", _BLOCK + r"layer_scale\2.lambda1"),
    (r"^vision_model\.blocks\.", _RADIO + "model.blocks."),
    (r"^vision_model\.patch_embed\.", _RADIO + "model.patch_generator.embedder."),
    (r"^vision_model\.pos_embed$", _RADIO + "model.patch_generator.pos_embed"),
    (r"^vision_model\.cls_token$", _RADIO + "model.patch_generator.cls_token.token"),
    (r"^vision_model\.video_patch_projection$",
     _RADIO + "model.patch_generator.video_embedder.weight"),
    (r"^vision_model\.summary_idxs$", _RADIO + "summary_idxs"),
    (r"^vision_model\.carried\.", ""),
    (r"^vision_model\.norm\.", "vision_projector.vision_final_layernorm."),
    (r"^projector\.norm\.", "mlp1.0."),
    (r"^projector\.fc1\.", "mlp1.1."),
    (r"^projector\.fc2\.", "mlp1.3."),
]
_POS_EMBED = "vision_model.pos_embed"
# the audio encoder and its projection (names as released, and as transformers names them)
AUDIO = re.compile(r"^(sound_encoder|sound_projection|audio_tower|embed_audio)\.")
_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
                "I64": "int64", "I32": "int32", "BOOL": "bool"}  # [G*G, D] here, [1, G*G, D] in the checkpoint


def is_omni_dir(local_dir: str | os.PathLike) -> bool:
    path = os.path.join(local_dir, "config.json")
    return os.path.isfile(path) and read_json(path).get("model_type") == OMNI_MODEL_TYPE


def hub_name(ours: str) -> str:
    """Our tensor name -> the ``nemotron_h_omni`` checkpoint's."""
    for pattern, repl in _TO_HUB:
        if re.match(pattern, ours):
            return re.sub(pattern, repl, ours)
    return ours


# ------------------------------------------------------------------------------ config
def _refuse(cond: bool, source: str, what: str) -> None:
    if cond:
        raise ValueError(f"{source}: {what}")


def _vision_config(v: Mapping[str, Any], final_norm: bool, source: str) -> VisionConfig:
    """RADIO's config (model type ``radio``) as ours (``final_norm``: transformers builds a
    LayerNorm after the ViT when the language model has MTP layers)."""
    where = f"{source} vision_config"
    _refuse(v.get("model_type", "radio") != "radio", where,
            f"model_type {v.get('model_type')!r}: only a RADIO encoder ('radio') is supported")
    _refuse(bool(v.get("use_swiglu_ffn")), where, "use_swiglu_ffn is not supported")
    _refuse(v.get("hidden_act", "gelu") != "gelu", where,
            f"hidden_act {v.get('hidden_act')!r}: only 'gelu' is supported")
    _refuse(not v.get("qkv_bias", True), where, "qkv_bias false is not supported")
    hidden, patch = v.get("hidden_size", 1280), v.get("patch_size", 16)
    video = v.get("video_temporal_patch_size")
    channels = v.get("num_channels", 3)
    return VisionConfig(
        hidden_size=hidden, num_hidden_layers=v.get("num_hidden_layers", 32),
        num_attention_heads=v.get("num_attention_heads", 16),
        intermediate_size=int(hidden * v.get("mlp_ratio", 4.0)), patch_size=patch,
        num_channels=channels, pos_grid=v.get("max_img_size", 2048) // patch,
        class_token_len=v.get("num_cls_tokens", 3) + v.get("num_registers", 7),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
        initializer_range=v.get("initializer_range", 0.02), patch_bias=False, layer_scale=True,
        final_norm=final_norm, pos_interpolation="crop",
        video_patch_dim=video * channels * patch * patch if video else 0,
        summary_tokens=len(v.get("summary_idxs") or [0, 1]))


def carried_tensors(local_dir: str | os.PathLike) -> dict:
    """{name: [shape, dtype]} of the audio encoder's tensors in ``local_dir``'s checkpoint."""
    found = read_checkpoint_header(checkpoint_files(local_dir))
    return {n: [list(shape), _DTYPE_NAMES[dt]] for n, (shape, dt, _) in found.items()
            if AUDIO.match(n)}


def config_from_omni(d: Mapping[str, Any], source: str = "config",
                     local_dir: str | os.PathLike | None = None) -> NemotronVLMConfig:
    """A ``nemotron_h_omni`` config.json dict -> our config (the dict kept for export). An
    audio encoder is carried frozen when the checkpoint folder (``local_dir``) is given."""
    fields = dict(d)
    for old, new in LEGACY_FIELDS.items():
        if old in fields and fields.get(new) is None:
            fields[new] = fields[old]
    audio = fields.get("audio_config")
    _refuse(audio is not None and local_dir is None, source,
            "this config has an audio encoder (`audio_config` / `sound_config`), which "
            "hybridtrain carries frozen from the checkpoint's tensors: load the folder "
            "(build_vlm(local_dir=...) / model.local_dir), not its config alone")
    text = NemotronHConfig.from_dict(fields.get("text_config") or {}, source=f"{source} text_config")
    num_mtp = (fields.get("text_config") or {}).get("num_nextn_predict_layers", 0) or 0
    vision = _vision_config(fields.get("vision_config") or {}, num_mtp > 0, source)
    if audio is not None:
        vision.carried = carried_tensors(local_dir)
    vh = fields.get("vision_hidden_size", vision.hidden_size)
    _refuse(vh != vision.hidden_size, source,
            f"vision_hidden_size {vh} differs from vision_config.hidden_size {vision.hidden_size}")
    ratio = fields.get("downsample_ratio", 0.5)
    _refuse(ratio != 0.5, source, f"downsample_ratio {ratio}: only 0.5 is supported")
    _refuse(fields.get("image_token_id") is None, source,
            "no image_token_id (or img_context_token_id)")
    return NemotronVLMConfig(
        text_config=text, vision_config=vision,
        projector_hidden_size=fields.get("projector_hidden_size", 4096),
        image_token_id=fields["image_token_id"], projector_norm_eps=1e-5,
        hf_omni_config={k: v for k, v in d.items() if k not in ("dtype", "torch_dtype")})


# ------------------------------------------------------------------------------ tensors
def save_omni(state_dict: Mapping[str, torch.Tensor], config: NemotronVLMConfig, out_dir, *,
              max_shard_size="5GB", dtype=None,
              tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """safetensors + config.json in the ``nemotron_h_omni`` layout transformers loads."""
    renamed = {hub_name(n): t for n, t in state_dict.items()}
    stream = None if tensors is None else ((hub_name(n), t) for n, t in tensors)
    save_hf_checkpoint(renamed, config, out_dir, max_shard_size=max_shard_size, dtype=dtype,
                       tensors=stream, layout_config=config.text_config)
