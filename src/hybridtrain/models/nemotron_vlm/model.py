"""The Nemotron-H vision-language model: ``vision_model`` (RADIO-style ViT) -> pixel shuffle ->
``projector`` -> embeddings scattered into the image placeholder positions of the
``language_model`` (an unchanged :class:`NemotronHForCausalLM`, called with ``inputs_embeds``).

The data layer repeats the placeholder token (``config.image_token_id``) once per embedding its
image gives, so the sequence length never changes here; a row whose placeholder count differs
from its images' embedding count is an error naming the row.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from hybridtrain.models.nemotron_h import NemotronHForCausalLM

from .config import NemotronVLMConfig
from .io import load_vlm, save_vlm
from .pipeline import images_from_rows
from .vision import Projector, RadioViT, pixel_shuffle

# the module groups a recipe can freeze (``freeze: [vision, language]``) -> attribute
MODULES = {"vision": "vision_model", "projector": "projector", "language": "language_model"}


class NemotronVLMForConditionalGeneration(nn.Module):
    """``forward(input_ids, position_ids=None, cu_seqlens=None, labels=None, pixel_values=None,
    image_grid=None, image_embeds=None)``: as the language model's forward (logits, or with
    ``labels`` the loss of the language model's ``loss``), with the images' embeddings in the
    placeholder positions (``image_embeds``: already projected, see
    :meth:`place_row_embeddings`)."""

    name_or_path: str | None = None  # the folder from_pretrained read
    checkpoint_dtype: torch.dtype | None = None  # the dtype it stored

    def __init__(self, config: NemotronVLMConfig, language_model: NemotronHForCausalLM | None = None):
        super().__init__()
        self.config = config
        self.vision_model = RadioViT(config.vision_config)
        self.projector = Projector(config)
        self.language_model = language_model if language_model is not None else \
            NemotronHForCausalLM(config.text_config)
        if not self.projector.fc1.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Vision and projector at random (normal(0, initializer_range)); the language model
        keeps its weights."""
        self.vision_model.init_weights()
        self.projector.init_weights(self.config.text_config.initializer_range)

    def init_units(self) -> list[tuple[str, Callable[[nn.Module], None]]]:
        """The initialisation in independent parts (see ``NemotronHForCausalLM.init_units``):
        the vision encoder, the projector, then the language model's parts."""
        std = self.config.text_config.initializer_range
        units = [("vision_model", RadioViT.init_weights),
                 ("projector", lambda m: Projector.init_weights(m, std))]
        return units + [(f"language_model.{name}", init)
                        for name, init in self.language_model.init_units()]

    def pipeline_stage(self, layer_ids: Iterable[int], is_first: bool, is_last: bool
                       ) -> "NemotronVLMForConditionalGeneration":
        """A model holding the language model's pipeline stage (see
        ``NemotronHForCausalLM.pipeline_stage``) and, on the first stage, the vision encoder and
        projector, which feed its embeddings (same modules, same parameter names)."""
        lm = self.language_model.pipeline_stage(layer_ids, is_first, is_last)
        with torch.device("meta"):
            stage = type(self)(self.config, language_model=lm)
        stage.vision_model = self.vision_model if is_first else None
        stage.projector = self.projector if is_first else None
        return stage

    # ------------------------------------------------------------------ training hooks
    @property
    def lm_head(self) -> nn.Module | None:
        """The output projection (``CausalLM.lm_head``; it lives in the language model)."""
        return None if self.language_model is None else self.language_model.lm_head

    @property
    def loss(self) -> nn.Module:
        """The loss the forward returns with ``labels`` (it lives in the language model)."""
        return self.language_model.loss

    def freeze(self, modules: Iterable[str]) -> None:
        """Stop training the named module groups (``vision``, ``projector``, ``language``)."""
        for name in modules:
            if name not in MODULES:
                raise ValueError(f"freeze: unknown module {name!r}; choose from {sorted(MODULES)}")
            getattr(self, MODULES[name]).requires_grad_(False)

    # ------------------------------------------------------------------ forward
    def image_embeddings(self, pixel_values: torch.Tensor, image_grid: torch.Tensor) -> torch.Tensor:
        """[tokens, text hidden]: projected embeddings of every image, in order. A frozen
        vision model runs without autograd."""
        trainable = any(p.requires_grad for p in self.vision_model.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and trainable):
            x = self.vision_model(pixel_values, image_grid)
        return self.projector(pixel_shuffle(x, image_grid, self.config.merge))

    def tokens_per_image(self, image_grid: torch.Tensor) -> list[int]:
        m = self.config.merge
        return [(h // m) * (w // m) for h, w in image_grid.tolist()]

    def _check_counts(self, placeholders: torch.Tensor, image_grid: torch.Tensor | None) -> None:
        """Each row's placeholders must take exactly the embeddings of whole images."""
        per_row = placeholders.sum(1).tolist()
        per_image = self.tokens_per_image(image_grid) if image_grid is not None else []
        k = 0
        for b, need in enumerate(per_row):
            got = 0
            while got < need and k < len(per_image):
                got += per_image[k]
                k += 1
            if got != need:
                raise ValueError(
                    f"row {b} of the batch has {need} image placeholder tokens (id "
                    f"{self.config.image_token_id}) but its images give {got} embeddings; the "
                    "data layer must repeat the placeholder once per image embedding")
        if k != len(per_image):
            raise ValueError(
                f"the batch has {len(per_image)} images but its placeholders take only {k}; "
                f"images {k}..{len(per_image) - 1} have no placeholder tokens (is the data's image token "
                f"the model's image_token_id {self.config.image_token_id}?)")

    def merge_embeddings(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None,
                         image_grid: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings [B, L, H] with ``image_embeds`` (of the images of ``image_grid``,
        in order) in the placeholder positions; the counts are checked row by row."""
        h = self.language_model.backbone.embeddings(input_ids)
        placeholders = input_ids == self.config.image_token_id
        has_images = image_grid is not None and image_grid.shape[0] > 0
        self._check_counts(placeholders, image_grid if has_images else None)
        if not has_images:
            return h
        return h.masked_scatter(placeholders.unsqueeze(-1), image_embeds.to(h.dtype))

    def place_row_embeddings(self, input_ids: torch.Tensor, image_embeds: torch.Tensor
                             ) -> torch.Tensor:
        """Token embeddings [B, L, H] with ``image_embeds`` [B, T, H] (row ``b``'s image
        embeddings in placeholder order, zero-padded after its count) in the placeholders."""
        h = self.language_model.backbone.embeddings(input_ids)
        placeholders = input_ids == self.config.image_token_id
        n = placeholders.sum(1)
        valid = torch.arange(image_embeds.shape[1], device=n.device)[None] < n[:, None]
        return h.masked_scatter(placeholders.unsqueeze(-1), image_embeds[valid].to(h.dtype))

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              image_grid: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`merge_embeddings` of the images' :meth:`image_embeddings`. A batch without
        images still runs the vision path once (on a blank image, added times zero), and
        always before the token embeddings, so that every data-parallel rank runs the same
        modules in the same order (FSDP's collectives, in training and in validation)."""
        has_images = image_grid is not None and image_grid.shape[0] > 0
        blank = None
        if has_images:
            img = self.image_embeddings(pixel_values, image_grid)
        else:
            m = self.config.merge
            grid = torch.tensor([[m, m]], device=input_ids.device)
            pixels = torch.zeros(m * m, self.config.vision_config.patch_dim, device=input_ids.device)
            blank = self.image_embeddings(pixels, grid)
        h = self.merge_embeddings(input_ids, img if has_images else None,
                                  image_grid if has_images else None)
        return h if blank is None else h + 0.0 * blank.sum()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.language_model.backbone.embeddings is None:  # a later pipeline stage
            return self.language_model(input_ids, position_ids=position_ids,
                                       cu_seqlens=cu_seqlens, labels=labels)
        if image_grid is not None and image_grid.dim() == 3:  # a pipeline micro-batch's rows
            pixel_values, image_grid = images_from_rows(pixel_values, image_grid)
        if image_embeds is not None:  # projected on other ranks (heterogeneous layout)
            embeds = self.place_row_embeddings(input_ids, image_embeds)
        else:
            embeds = self.embed(input_ids, pixel_values, image_grid)
        return self.language_model(None, position_ids=position_ids, cu_seqlens=cu_seqlens,
                                   labels=labels, inputs_embeds=embeds)

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_pretrained(cls, local_dir: str | os.PathLike, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None,
                        freeze: Sequence[str] = ()) -> "NemotronVLMForConditionalGeneration":
        """Load a saved vision-language model (safetensors + config.json)."""
        model = load_vlm(cls, local_dir, dtype=dtype, device=device)
        model.freeze(freeze)
        return model

    def save_pretrained(self, save_dir: str | os.PathLike, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | str | None = None,
                        state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write safetensors (the language model's experts per expert, as on the Hub) and
        config.json."""
        sd = self.state_dict() if state_dict is None else state_dict
        save_vlm(sd, self.config, save_dir, max_shard_size=max_shard_size, dtype=dtype)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
