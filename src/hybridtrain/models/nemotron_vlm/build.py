"""Recipe entry points: ``build_vlm`` (a YAML ``model:`` ``_target_``) and a tiny config."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridtrain.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM, tiny_config

from hybridtrain.config.dtypes import to_torch_dtype
from .config import NemotronVLMConfig, VisionConfig
from .model import NemotronVLMForConditionalGeneration


def tiny_vlm_config(image_token_id: int = 255, text: Mapping | NemotronHConfig | None = None,
                    **overrides: Any) -> NemotronVLMConfig:
    """A tiny VLM: the tiny 'mixed' Nemotron-H (or ``text``: its overrides or a config), a
    2-block ViT of width 32 on 4-pixel patches with 2 class tokens, projector width 64."""
    if not isinstance(text, NemotronHConfig):
        text = tiny_config("mixed", **dict(text or {}))
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, patch_size=4, pos_grid=8, class_token_len=2)
    vision.update(overrides.pop("vision_config", {}))
    d = dict(text_config=text, vision_config=VisionConfig(**vision), projector_hidden_size=64,
             image_token_id=image_token_id)
    d.update(overrides)
    return NemotronVLMConfig(**d)


def build_vlm(config: NemotronVLMConfig | Mapping | None = None, *,
              language_model_dir: str | None = None, local_dir: str | None = None,
              dtype: str | None = None, freeze: Sequence[str] = (),
              device: torch.device | str | None = None,
              **config_fields: Any) -> NemotronVLMForConditionalGeneration:
    """The model of a recipe.

    * ``local_dir``: a saved vision-language model (safetensors + config.json), read onto
      ``device`` (``meta``: checked, its weights read after the layout, as the builder does);
    * else ``config`` (a config or its fields) or ``config_fields``; with ``language_model_dir``
      the language model loads from that Nemotron-H Hugging Face folder (its config replaces
      ``text_config``), the vision encoder and projector start at random.

    ``freeze``: module groups not trained: any of ``vision``, ``projector``, ``language``
    (stage 1 alignment: ``[vision, language]``; stage 2: ``[vision]``).
    """
    if local_dir is not None:
        return NemotronVLMForConditionalGeneration.from_pretrained(
            local_dir, dtype=dtype, device=device, freeze=freeze)
    fields = dict(config.__dict__ if isinstance(config, NemotronVLMConfig) else (config or {}))
    fields.update(config_fields)
    lm = None
    if language_model_dir is not None:
        lm = NemotronHForCausalLM.from_pretrained(language_model_dir, dtype=dtype)
        fields["text_config"] = lm.config
    if "text_config" not in fields:
        raise ValueError("build_vlm: give text_config, language_model_dir or local_dir")
    model = NemotronVLMForConditionalGeneration(NemotronVLMConfig(**fields), language_model=lm)
    if dtype is not None:
        model.to(to_torch_dtype(dtype))
    model.freeze(freeze)
    return model
