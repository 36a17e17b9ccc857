"""The vision-language model's images in pipeline micro-batches: one entry per row.

A collated batch holds its images packed (``pixel_values`` [patches, C*p*p], ``image_grid``
[images, 2], in the order of the rows' placeholders). A pipeline schedule splits its inputs by
rows, so the first stage (ViT + projector + embeddings) gets each row's own images:
:func:`images_by_row` lays them out as ``image_grid`` [rows, images, 2] (all-zero grid entries:
no image) and ``pixel_values`` [rows, patches, C*p*p] (zero-padded), and
:func:`images_from_rows` packs a micro-batch's rows back."""

from __future__ import annotations

import torch

from .config import NemotronVLMConfig


def images_by_row(config: NemotronVLMConfig, batch: dict) -> dict[str, torch.Tensor]:
    """``{"image_grid": [B, N, 2], "pixel_values": [B, P, C*p*p]}`` of a collated batch: row
    ``b`` takes the images whose embeddings fill its placeholders (images beyond every
    placeholder go to the last row, where the model's count check names them). A batch of the
    heterogeneous layout carries its rows' projected ``image_embeds`` already (see
    :mod:`.hetero`): those are its row inputs."""
    if "image_embeds" in batch:
        return {"image_embeds": batch["image_embeds"]}
    ids = batch["input_ids"]
    grid, pixels = batch.get("image_grid"), batch.get("pixel_values")
    if grid is None:
        grid = torch.zeros(0, 2, dtype=torch.long, device=ids.device)
        pixels = torch.zeros(0, config.vision_config.patch_dim, device=ids.device)
    m = config.merge
    tokens = ((grid[:, 0] // m) * (grid[:, 1] // m)).tolist()
    ends = torch.cumsum(grid[:, 0] * grid[:, 1], 0).tolist()
    rows: list[list[int]] = [[] for _ in range(ids.shape[0])]
    k = 0
    for b, need in enumerate((ids == config.image_token_id).sum(1).tolist()):
        got = 0
        while got < need and k < len(tokens):
            rows[b].append(k)
            got += tokens[k]
            k += 1
    rows[-1] += range(k, len(tokens))
    n = max(len(r) for r in rows)
    span = [(ends[r[0] - 1] if r and r[0] else 0, ends[r[-1]] if r else 0) for r in rows]
    p = max(b - a for a, b in span)
    out_grid = grid.new_zeros(len(rows), n, 2)
    out_pixels = pixels.new_zeros(len(rows), p, pixels.shape[-1])
    for b, (r, (a, e)) in enumerate(zip(rows, span)):
        out_grid[b, :len(r)] = grid[r]
        out_pixels[b, :e - a] = pixels[a:e]
    return {"image_grid": out_grid, "pixel_values": out_pixels}


def images_from_rows(pixel_values: torch.Tensor, image_grid: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [patches, C*p*p], image_grid [images, 2]) packed from the per-row layout."""
    counts = (image_grid[..., 0] * image_grid[..., 1]).sum(1).tolist()
    pixels = torch.cat([pixel_values[b, :c] for b, c in enumerate(counts)]) if counts else \
        pixel_values.reshape(0, pixel_values.shape[-1])
    grid = image_grid.reshape(-1, 2)
    return pixels, grid[grid[:, 0] > 0]
