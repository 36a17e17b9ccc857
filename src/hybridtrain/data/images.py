"""Images for vision-language data: read with Pillow, resized to a patch budget keeping the
aspect ratio, normalised, cut into flattened patches.

::

    patch_grid(width, height, patch_size, min_patches, max_patches, multiple=2) -> (rows, cols)
    load_patches(path, grid, patch_size, mean, std) -> Tensor [rows * cols, 3 * p * p]
    patchify(pixels [C, H, W], patch_size) -> Tensor [H/p * W/p, C * p * p]

A patch is flattened channel-major (``c, dy, dx``); patches are in row-major order. Grid sides
are multiples of ``multiple`` so that a model can merge ``multiple x multiple`` neighbours.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from .io import DataError

# CLIP / RADIO normalisation
DEFAULT_MEAN = (0.48145466, 0.4578275, 0.40821073)
DEFAULT_STD = (0.26862954, 0.26130258, 0.27577711)


def _open(path: str | os.PathLike):
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path)
    except FileNotFoundError:
        raise DataError(f"image {path} does not exist") from None
    except Image.DecompressionBombError as e:  # its header claims more pixels than is safe
        raise DataError(f"image {path} is refused: {e} Downscale it (it is resized to the "
                        "patch budget anyway)") from None
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"image {path} cannot be read: {e}") from None


def image_size(path: str | os.PathLike) -> tuple[int, int]:
    """(width, height) from the file's header (the pixels are not decoded)."""
    with _open(path) as im:
        return im.size


def patch_grid(width: int, height: int, patch_size: int, min_patches: int, max_patches: int,
               multiple: int = 2) -> tuple[int, int]:
    """(rows, cols) of patches for an image of ``width x height`` pixels: its own aspect ratio,
    scaled so that ``min_patches <= rows * cols <= max_patches``, sides multiples of
    ``multiple``."""
    if not 1 <= min_patches <= max_patches:
        raise ValueError(f"need 1 <= min_patches ({min_patches}) <= max_patches ({max_patches})")
    if max_patches < multiple * multiple:
        raise ValueError(f"max_patches={max_patches} is below one {multiple}x{multiple} block")
    rows, cols = height / patch_size, width / patch_size
    n = rows * cols
    scale = math.sqrt(max_patches / n) if n > max_patches else (
        math.sqrt(min_patches / n) if n < min_patches else 1.0)

    def side(x: float) -> int:
        return max(multiple, int(round(x * scale / multiple)) * multiple)

    r, c = side(rows), side(cols)
    while r * c > max_patches:  # rounding went over: shrink the longer side
        if r >= c:
            r -= multiple
        else:
            c -= multiple
    while r * c < min_patches and (r + multiple) * c <= max_patches:
        if r <= c:
            r += multiple
        elif r * (c + multiple) <= max_patches:
            c += multiple
        else:
            r += multiple
    return r, c


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    C, H, W = pixels.shape
    p = patch_size
    assert H % p == 0 and W % p == 0, (H, W, p)
    x = pixels.view(C, H // p, p, W // p, p).permute(1, 3, 0, 2, 4)
    return x.reshape((H // p) * (W // p), C * p * p)


def _rgb(im):
    """``im`` as 8-bit RGB; 16- and 32-bit grey samples are scaled down, not clipped."""
    if im.mode.startswith("I;16") or im.mode == "I":
        im = im.point(lambda v: v * (1 / 256)).convert("L")
    elif im.mode == "F":  # floating-point samples, taken as [0, 1]
        im = im.point(lambda v: v * 255).convert("L")
    return im.convert("RGB")


def load_patches(path: str | os.PathLike, grid: tuple[int, int], patch_size: int,
                 mean: Sequence[float] = DEFAULT_MEAN, std: Sequence[float] = DEFAULT_STD
                 ) -> torch.Tensor:
    """The image at ``path`` as RGB, resized (bicubic) to ``grid`` patches, scaled to [0, 1],
    normalised by ``mean`` / ``std``, flattened into patches."""
    from PIL import Image

    rows, cols = grid
    with _open(path) as im:
        try:  # the pixels are decoded here: a truncated or damaged file fails only now
            im = _rgb(im).resize((cols * patch_size, rows * patch_size),
                                          Image.Resampling.BICUBIC)
        except (OSError, SyntaxError, ValueError) as e:
            raise DataError(f"image {path} is truncated or corrupt ({e}); replace the file or "
                            "remove the records that use it") from None
        data = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    x = data.view(rows * patch_size, cols * patch_size, 3).permute(2, 0, 1).float() / 255.0
    x = (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    return patchify(x, patch_size)
