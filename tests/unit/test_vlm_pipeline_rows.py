"""The vision-language model's images per row (the pipeline's micro-batch layout): rows take
the images of their placeholders, a micro-batch of rows packs back to its own images, and the
first pipeline stage on rows computes what the whole model computes on the packed batch."""

import torch

from hybridtrain.data.micro_batches import merge_row_inputs
from hybridtrain.models.nemotron_vlm import NemotronVLMForConditionalGeneration, tiny_vlm_config
from hybridtrain.models.nemotron_vlm.pipeline import images_by_row, images_from_rows

IMG = 255


def _batch():
    """Rows: two images (4x4 -> 4 tokens, 2x4 -> 2 tokens), none, one (4x2 -> 2 tokens)."""
    grid = torch.tensor([[4, 4], [2, 4], [4, 2]])
    pixels = torch.randn(int((grid[:, 0] * grid[:, 1]).sum()), 48)
    ids = torch.randint(0, 200, (3, 12))
    ids[0, 1:5] = IMG
    ids[0, 7:9] = IMG
    ids[2, 3:5] = IMG
    return {"input_ids": ids, "labels": ids, "image_grid": grid, "pixel_values": pixels}


def test_rows_take_their_images_and_pack_back():
    cfg, b = tiny_vlm_config(), _batch()
    rows = images_by_row(cfg, b)
    assert rows["image_grid"].shape == (3, 2, 2) and rows["pixel_values"].shape == (3, 24, 48)
    assert rows["image_grid"][1].eq(0).all() and rows["image_grid"][2, 1].eq(0).all()
    pv, grid = images_from_rows(rows["pixel_values"], rows["image_grid"])
    assert torch.equal(grid, b["image_grid"]) and torch.equal(pv, b["pixel_values"])
    # a micro-batch of the last two rows holds only the last image
    pv, grid = images_from_rows(rows["pixel_values"][1:], rows["image_grid"][1:])
    assert torch.equal(grid, b["image_grid"][2:]) and torch.equal(pv, b["pixel_values"][24:])
    # micro-batches of different sizes merge (zero-padded) along the rows
    merged = merge_row_inputs([b, {"input_ids": b["input_ids"][1:2]}],
                              lambda mb: images_by_row(cfg, mb))
    assert merged["image_grid"].shape == (4, 2, 2) and merged["image_grid"][3].eq(0).all()


def test_first_stage_on_rows_matches_the_model():
    torch.manual_seed(0)
    model = NemotronVLMForConditionalGeneration(tiny_vlm_config()).eval()
    b = _batch()
    layers = list(model.language_model.backbone.layers)
    stage = model.pipeline_stage([int(k) for k in layers], True, True)
    assert dict(stage.named_parameters()).keys() == dict(model.named_parameters()).keys()
    want = model(b["input_ids"], pixel_values=b["pixel_values"], image_grid=b["image_grid"])
    rows = images_by_row(model.config, b)
    got = torch.cat([stage(b["input_ids"][i:i + 1], pixel_values=rows["pixel_values"][i:i + 1],
                           image_grid=rows["image_grid"][i:i + 1]) for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    later = model.pipeline_stage([int(layers[-1])], False, True)
    assert later.vision_model is None and later.projector is None
