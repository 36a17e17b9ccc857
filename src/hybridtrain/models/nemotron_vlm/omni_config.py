"""The field translation of transformers' ``nemotron_h_omni`` config.json (and the released
checkpoints' legacy names) into the fields of :class:`~.config.NemotronVLMConfig`; plain dicts,
so that the config class can read either layout without importing the tensor code of
:mod:`.omni`."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from hybridtrain.models.nemotron_h.config import NemotronHConfig
from hybridtrain.models.nemotron_h.hf_io import checkpoint_files, read_checkpoint_header

OMNI_MODEL_TYPE = "nemotron_h_omni"  # transformers' NemotronH_Omni_Reasoning_V3

# released checkpoints' names -> transformers' (as NemotronH_Omni_Reasoning_V3_Config maps them)
LEGACY_FIELDS = {"img_context_token_id": "image_token_id", "llm_config": "text_config",
                 "vit_hidden_size": "vision_hidden_size", "sound_config": "audio_config",
                 "video_context_token_id": "video_token_id",
                 "sound_context_token_id": "audio_token_id"}
AUDIO = re.compile(r"^(sound_encoder|sound_projection|audio_tower|embed_audio)\.")
_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
                "I64": "int64", "I32": "int32", "BOOL": "bool"}  # [G*G, D] here, [1, G*G, D] in the checkpoint


def _refuse(cond: bool, source: str, what: str) -> None:
    if cond:
        raise ValueError(f"{source}: {what}")


def _vision_fields(v: Mapping[str, Any], final_norm: bool, source: str) -> dict[str, Any]:
    """RADIO's config (model type ``radio``) as our ``VisionConfig``'s fields (``final_norm``: transformers builds a
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
    return dict(
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


def omni_fields(d: Mapping[str, Any], source: str = "config",
                local_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """A ``nemotron_h_omni`` config.json dict -> our ``NemotronVLMConfig``'s fields, the vision
    config's as a dict (the original dict kept for export). An audio encoder is carried frozen
    when the checkpoint folder (``local_dir``) is given."""
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
    vision = _vision_fields(fields.get("vision_config") or {}, num_mtp > 0, source)
    if audio is not None:
        vision["carried"] = carried_tensors(local_dir)
    vh = fields.get("vision_hidden_size", vision["hidden_size"])
    _refuse(vh != vision["hidden_size"], source,
            f"vision_hidden_size {vh} differs from vision_config.hidden_size {vision['hidden_size']}")
    ratio = fields.get("downsample_ratio", 0.5)
    _refuse(ratio != 0.5, source, f"downsample_ratio {ratio}: only 0.5 is supported")
    _refuse(fields.get("image_token_id") is None, source,
            "no image_token_id (or img_context_token_id)")
    return dict(
        text_config=text, vision_config=vision,
        projector_hidden_size=fields.get("projector_hidden_size", 4096),
        image_token_id=fields["image_token_id"], projector_norm_eps=1e-5,
        hf_omni_config={k: v for k, v in d.items() if k not in ("dtype", "torch_dtype")})
