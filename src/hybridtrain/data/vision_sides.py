"""What each side of a model split over rank sets reads of a vision dataset (a
:class:`~hybridtrain.data.vision_chat.VisionChatDataset`, packed or not): the ranks that run
the language model read the text and the image grids, no image; the ranks that run only the
vision encoder read the images of the samples they serve, nothing else.

* :class:`TextSide` ``(dataset)``: the examples without ``pixel_values`` (no image decoded).
* :class:`ImageSide` ``(dataset, select)``: items are ``(lane, index)`` keys; its
  :meth:`~ImageSide.collate` groups a batch's keys by lane and decodes, per lane, only the
  images ``select(lane, number of images)`` picks (a contiguous ``(start, end)``). A batch is
  ``image_grid`` [images, 2] and ``pixel_values`` [patches, C*p*p] of every lane in turn,
  ``lane_images`` [lanes] (how many images each lane gave) and empty ``input_ids`` / ``labels``
  (no text: the side counts no tokens).
* :class:`LaneSampler` ``(sampler, lanes)``: a batch sampler reading for several lanes at once:
  micro-batch ``i`` holds micro-batch ``i`` of each lane's sampler (``sampler.for_rank(lane)``),
  as ``(position, index)`` keys for :class:`ImageSide`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Subset

from .contract import HoldsImages


def _base(dataset) -> tuple[object, Callable[[int], int]]:
    """(the vision dataset under an optional ``Subset``, index map into it)."""
    if isinstance(dataset, Subset):
        return dataset.dataset, dataset.indices.__getitem__
    return dataset, int


def _check(base) -> None:
    if not isinstance(base, HoldsImages):
        raise ValueError(f"{type(base).__name__} holds no images: a model whose encoder runs on "
                         "its own ranks trains on a vision dataset (build_vision_chat_dataset)")


class TextSide(Dataset):
    def __init__(self, dataset):
        self.base, self.index = _base(dataset)
        _check(self.base)
        self.n = len(dataset)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.base.item(self.index(i), pixels=False)


class ImageSide(Dataset):
    def __init__(self, dataset, select: Callable[[int, int], tuple[int, int]]):
        self.base, self.index = _base(dataset)
        _check(self.base)
        self.n, self.select = len(dataset), select

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, list]:
        lane, i = key
        return lane, self.base.image_list(self.index(i))

    def collate(self, items: Sequence[tuple[int, list]]) -> dict[str, torch.Tensor]:
        lanes: dict[int, list] = {}
        for lane, images in items:
            lanes.setdefault(lane, []).extend(images)
        chosen, counts = [], []
        for lane in sorted(lanes):
            a, b = self.select(lane, len(lanes[lane]))
            chosen += lanes[lane][a:b]
            counts.append(b - a)
        empty = torch.zeros(0, 0, dtype=torch.long)
        return {"image_grid": torch.tensor([g for _, g in chosen], dtype=torch.long).view(-1, 2),
                "pixel_values": self.base.load_pixels(chosen),
                "lane_images": torch.tensor(counts, dtype=torch.long),
                "input_ids": empty, "labels": empty}


class LaneSampler:
    def __init__(self, sampler, lanes: Sequence[int]):
        self.samplers = [sampler.for_rank(lane) for lane in lanes]

    def __len__(self) -> int:
        return len(self.samplers[0])

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for parts in zip(*self.samplers):
            yield [(pos, i) for pos, part in enumerate(parts) for i in part]
