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

import torch

from hybridtrain.fileio import read_json
from hybridtrain.models.nemotron_h.hf_io import save_hf_checkpoint

from .config import OMNI_MODEL_TYPE, NemotronVLMConfig

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


def is_omni_dir(local_dir: str | os.PathLike) -> bool:
    path = os.path.join(local_dir, "config.json")
    return os.path.isfile(path) and read_json(path).get("model_type") == OMNI_MODEL_TYPE


def hub_name(ours: str) -> str:
    """Our tensor name -> the ``nemotron_h_omni`` checkpoint's."""
    for pattern, repl in _TO_HUB:
        if re.match(pattern, ours):
            return re.sub(pattern, repl, ours)
    return ours


# ------------------------------------------------------------------------------ tensors
def save_omni(state_dict: Mapping[str, torch.Tensor], config: NemotronVLMConfig, out_dir, *,
              max_shard_size="5GB", dtype=None,
              tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """safetensors + config.json in the ``nemotron_h_omni`` layout transformers loads."""
    renamed = {hub_name(n): t for n, t in state_dict.items()}
    stream = None if tensors is None else ((hub_name(n), t) for n, t in tensors)
    save_hf_checkpoint(renamed, config, out_dir, max_shard_size=max_shard_size, dtype=dtype,
                       tensors=stream, layout_config=config.text_config)
