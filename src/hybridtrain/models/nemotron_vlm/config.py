"""Configuration of the Nemotron-H vision-language model: a RADIO-style ViT, a pixel-shuffle +
MLP projector and a Nemotron-H language model (``text_config``)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hybridtrain.fileio import read_json
from hybridtrain.models.nemotron_h.config import NemotronHConfig

from .omni_config import OMNI_MODEL_TYPE, omni_fields

MODEL_TYPE = "nemotron_h_vlm"


@dataclass
class VisionConfig:
    """The ViT: ``patch_size`` pixels square patches, learned position embeddings on a
    ``pos_grid`` x ``pos_grid`` grid (interpolated to each image's grid), ``class_token_len``
    class tokens per image, pre-norm blocks (LayerNorm, bidirectional attention, GELU MLP).

    The RADIO variants of released checkpoints (see :mod:`.omni`): ``patch_bias`` false,
    ``layer_scale`` (a learned per-channel scale on each residual branch), ``final_norm`` false
    (no LayerNorm after the blocks), ``pos_interpolation: crop`` (the grid resized to a square of
    the image's longer side, then cropped to its grid, as RADIO's CPE), ``video_patch_dim`` (the
    video patch projection, carried frozen: images never use it) and ``summary_tokens`` (the
    summary indices buffer, carried)."""

    hidden_size: int = 1280
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    intermediate_size: int = 5120
    patch_size: int = 16
    num_channels: int = 3
    pos_grid: int = 128
    class_token_len: int = 8
    layer_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    patch_bias: bool = True
    layer_scale: bool = False
    final_norm: bool = True
    pos_interpolation: str = "resize"
    video_patch_dim: int = 0
    summary_tokens: int = 0
    # tensors of the checkpoint no module here uses (an audio encoder), carried frozen to the
    # export: {checkpoint name: [shape, dtype name]}
    carried: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pos_interpolation not in ("resize", "crop"):
            raise ValueError(f"vision_config: pos_interpolation {self.pos_interpolation!r}: "
                             "choose 'resize' or 'crop'")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision_config: hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch (channels x patch_size^2)."""
        return self.num_channels * self.patch_size ** 2


@dataclass
class NemotronVLMConfig:
    """``downsample_ratio`` 0.5: pixel shuffle merges 2x2 patches into one token before the
    projector (RMSNorm -> linear -> squared ReLU -> linear to the LM's width);
    ``image_token_id``: the placeholder token the data layer repeats once per image embedding."""

    text_config: NemotronHConfig
    model_type: ClassVar[str] = MODEL_TYPE
    vision_config: VisionConfig = field(default_factory=VisionConfig)
    projector_hidden_size: int = 4096
    downsample_ratio: float = 0.5
    image_token_id: int = 0
    projector_norm_eps: float | None = None  # None: the language model's layer_norm_epsilon
    # the transformers ``nemotron_h_omni`` config.json this model was read from: saved back as
    # it is, with the tensors in that layout (see :mod:`.omni`)
    hf_omni_config: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.text_config, dict):
            self.text_config = NemotronHConfig.from_dict(self.text_config, source="text_config")
        if isinstance(self.vision_config, dict):
            self.vision_config = VisionConfig(**self.vision_config)
        if self.downsample_ratio != 0.5:
            raise ValueError(f"downsample_ratio={self.downsample_ratio}: only 0.5 (2x2 pixel "
                             "shuffle) is supported")
        if not 0 <= self.image_token_id < self.text_config.vocab_size:
            raise ValueError(f"image_token_id {self.image_token_id} is outside the vocabulary "
                             f"(vocab_size {self.text_config.vocab_size})")

    # what generic code reads from a model's config
    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def context_length(self) -> int | None:
        return self.text_config.context_length

    @property
    def merge(self) -> int:
        """Patches per side merged into one token (2 for ratio 0.5)."""
        return round(1 / self.downsample_ratio)

    def to_dict(self, dtype: str | None = None) -> dict[str, Any]:
        if self.hf_omni_config is not None:
            return {**self.hf_omni_config, **({"dtype": dtype} if dtype else {})}
        return {
            "model_type": MODEL_TYPE,
            "text_config": self.text_config.to_hf_dict(dtype),
            "vision_config": dataclasses.asdict(self.vision_config),
            "projector_hidden_size": self.projector_hidden_size,
            "downsample_ratio": self.downsample_ratio,
            "image_token_id": self.image_token_id,
            **({"projector_norm_eps": self.projector_norm_eps}
               if self.projector_norm_eps is not None else {}),
            **({"torch_dtype": dtype} if dtype else {}),
        }

    def to_json_string(self, dtype: str | None = None) -> str:
        return json.dumps(self.to_dict(dtype), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "NemotronVLMConfig":
        d = dict(d)
        mt = d.pop("model_type", MODEL_TYPE)
        if mt == OMNI_MODEL_TYPE:
            return cls.from_omni_fields(omni_fields({"model_type": mt, **d}, source))
        if mt != MODEL_TYPE:
            raise ValueError(f"{source}: `model_type` is {mt!r}, expected {MODEL_TYPE!r} or "
                             f"{OMNI_MODEL_TYPE!r}")
        d.pop("torch_dtype", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown}")
        return cls(**d)

    @classmethod
    def from_omni_fields(cls, fields: dict[str, Any]) -> "NemotronVLMConfig":
        """The config of :func:`~.omni_config.omni_fields`' translation."""
        return cls(**{**fields, "vision_config": VisionConfig(**fields["vision_config"])})

    @classmethod
    def from_pretrained(cls, local_dir: str | os.PathLike) -> "NemotronVLMConfig":
        path = os.path.join(local_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{local_dir}: no config.json (expected a saved vision-language model)")
        d = read_json(path)
        if d.get("model_type") == OMNI_MODEL_TYPE:
            return cls.from_omni_fields(omni_fields(d, path, local_dir=local_dir))
        return cls.from_dict(d, source=path)
