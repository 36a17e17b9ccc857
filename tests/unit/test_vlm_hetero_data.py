"""What each side of the heterogeneous vision-language layout reads: a language lane its own
samples' text and image grids, no pixels; an encoder rank the pixels of exactly its share of
the images of the lanes it serves (fan-out: whole lanes, fan-in: contiguous shares), so that
the encoder ranks serving a lane together read that lane's images, in order, once."""

import pytest
import torch

from hybridtrain.distributed.bridge import BridgeLayout
from hybridtrain.models.nemotron_vlm.hetero import data_view
from hybridtrain.training.step_scheduler import EvalBatchSampler, MicroBatchSampler
from tests.helpers import parity, vlm


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return vlm.hetero_data(str(tmp_path_factory.mktemp("vlm_sides")))


def _read(view, ds, collate, sampler):
    side, side_sampler, side_collate = view(ds, sampler, collate)
    return [side_collate([side[k] for k in keys]) for keys in side_sampler]


@pytest.mark.parametrize("encoders,lanes", [(2, 2), (1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("split", ["train", "validation", "packed"])
def test_each_side_reads_its_own_part(data, encoders, lanes, split):
    ds, collate = data
    if split == "packed":  # rows of several samples and images
        from hybridtrain.data import build_collator

        ds = torch.utils.data.Subset(ds.pack(128), range(12))
        collate = build_collator(ds.dataset)
    layout = BridgeLayout(range(encoders), range(encoders, encoders + lanes))

    def sampler(lane):
        if split != "validation":
            return MicroBatchSampler(len(ds), parity.MBS, 2, lane, lanes, seed=3)
        return EvalBatchSampler(len(ds) - 3, parity.MBS, lane, lanes)

    full = {lane: [collate([ds[i] for i in keys]) for keys in sampler(lane)]
            for lane in range(lanes)}
    assert any(mb["image_grid"].shape[0] == 0 for f in full.values() for mb in f) or \
        split != "train"
    served = {lane: [[] for _ in full[lane]] for lane in range(lanes)}
    for rank in layout.senders:  # an encoder rank's data loop starts from lane 0's sampler
        for i, mb in enumerate(_read(data_view(layout, rank), ds, collate, sampler(0))):
            assert mb["input_ids"].numel() == 0 and mb["labels"].numel() == 0
            grids = mb["image_grid"].split(mb["lane_images"].tolist())
            pixels = mb["pixel_values"].split([int(g.prod(1).sum()) for g in grids])
            for (dst, _, _), g, p in zip(layout.routes(rank), grids, pixels):
                served[layout.receivers.index(dst)][i].append((g, p))
    for lane, rank in enumerate(layout.receivers):
        got = _read(data_view(layout, rank), ds, collate, sampler(lane))
        assert len(got) == len(full[lane])
        for i, (mb, ref) in enumerate(zip(got, full[lane])):
            assert "pixel_values" not in mb  # no image decoded on a language lane
            assert torch.equal(mb["input_ids"], ref["input_ids"])
            assert torch.equal(mb["image_grid"], ref["image_grid"])
            shares = served[lane][i]
            assert len(shares) == len(layout.sources(rank))
            assert torch.equal(torch.cat([g for g, _ in shares]), ref["image_grid"])
            assert torch.equal(torch.cat([p for _, p in shares]), ref["pixel_values"])


def test_a_text_dataset_is_refused(data):
    from hybridtrain.data.vision_sides import TextSide

    with pytest.raises(ValueError, match="holds no images"):
        TextSide([{"input_ids": torch.zeros(3)}])
