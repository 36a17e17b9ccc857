"""The vision-language model: per-image attention under dynamic resolution, position-embedding
interpolation, placeholder scatter and its errors, text-only batches, freezing, I/O."""

import pytest
import torch
import torch.nn.functional as F

from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
from hybridtrain.models.nemotron_vlm import (
    NemotronVLMForConditionalGeneration,
    build_vlm,
    tiny_vlm_config,
)
from hybridtrain.models.nemotron_vlm.vision import pixel_shuffle
from hybridtrain.models.spec import get_model_spec, model_spec_for

IMG = 255  # the tiny config's image token id


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return NemotronVLMForConditionalGeneration(tiny_vlm_config(**kw)).eval()


def _images(grids, seed=1):
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grids)
    n = int((grid[:, 0] * grid[:, 1]).sum())
    return torch.randn(n, 48, generator=g), grid


def test_spec_registered():
    m = _model()
    assert model_spec_for(m) is get_model_spec("nemotron_h_vlm")


def test_images_do_not_attend_to_each_other():
    m = _model()
    pv, grid = _images([[4, 6], [2, 2], [6, 4]])
    packed = m.vision_model(pv, grid)
    start, alone = 0, []
    for h, w in grid.tolist():
        alone.append(m.vision_model(pv[start:start + h * w], torch.tensor([[h, w]])))
        start += h * w
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-6)
    assert packed.shape == (pv.shape[0], 32)  # class tokens dropped


def test_position_embeddings_interpolated_per_grid():
    vit = _model().vision_model
    g = vit.config.pos_grid
    assert torch.equal(vit.position_embeddings(g, g), vit.pos_embed)
    grid = vit.pos_embed.view(1, g, g, -1).permute(0, 3, 1, 2)
    ref = F.interpolate(grid, size=(4, 6), mode="bilinear", align_corners=False)
    torch.testing.assert_close(vit.position_embeddings(4, 6), ref[0].permute(1, 2, 0).reshape(24, -1))


def test_pixel_shuffle_merges_2x2_neighbours():
    x = torch.arange(4 * 6).float().view(24, 1)
    out = pixel_shuffle(x, torch.tensor([[4, 6]]))
    assert out.shape == (6, 4)
    assert out[0].tolist() == [0, 1, 6, 7] and out[1].tolist() == [2, 3, 8, 9]


def test_embeddings_scattered_into_placeholders():
    m = _model()
    pv, grid = _images([[4, 6], [2, 2]])
    ids = torch.randint(0, 200, (2, 12))
    ids[0, 2:8] = IMG  # 6 embeddings of image 0
    ids[1, 5] = IMG    # 1 of image 1
    h = m.embed(ids, pv, grid)
    img = m.image_embeddings(pv, grid)
    torch.testing.assert_close(h[0, 2:8], img[:6])
    torch.testing.assert_close(h[1, 5], img[6])
    text = m.language_model.backbone.embeddings(ids)
    keep = ids != IMG
    assert torch.equal(h[keep], text[keep])


def test_placeholder_count_mismatch_names_the_row():
    m = _model()
    pv, grid = _images([[4, 6], [2, 2]])
    ids = torch.randint(0, 200, (2, 12))
    ids[0, 2:8] = IMG
    ids[1, 5:7] = IMG  # 2 placeholders, image 1 gives 1
    with pytest.raises(ValueError, match="row 1 .* 2 image placeholder tokens"):
        m(ids, pixel_values=pv, image_grid=grid)
    ids[1, 5:7] = 7
    with pytest.raises(ValueError, match="images 1..1 have no placeholder"):
        m(ids, pixel_values=pv, image_grid=grid)


def test_text_only_batch_equals_language_model_and_reaches_vision():
    m = _model().train()
    ids = torch.randint(0, 200, (2, 10))
    loss = m(ids, labels=ids)
    ref = m.language_model(ids, labels=ids)
    assert torch.equal(loss, ref)
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in m.vision_model.parameters())


def test_freeze_and_frozen_vision_runs_without_autograd():
    m = _model()
    m.freeze(["vision", "language"])
    assert not any(p.requires_grad for p in m.vision_model.parameters())
    assert not any(p.requires_grad for p in m.language_model.parameters())
    assert all(p.requires_grad for p in m.projector.parameters())
    pv, grid = _images([[2, 2]])
    assert m.image_embeddings(pv, grid).requires_grad  # through the projector
    with pytest.raises(ValueError, match="unknown module 'text'"):
        m.freeze(["text"])


def test_save_load_roundtrip(tmp_path):
    m = _model()
    m.save_pretrained(tmp_path / "vlm")
    assert (tmp_path / "vlm" / "config.json").is_file()
    assert (tmp_path / "vlm" / "model.safetensors").is_file()
    back = build_vlm(local_dir=str(tmp_path / "vlm"), freeze=["vision"])
    pv, grid = _images([[4, 6]])
    ids = torch.randint(0, 200, (1, 10))
    ids[0, 1:7] = IMG
    assert torch.equal(m(ids, pixel_values=pv, image_grid=grid),
                       back(ids, pixel_values=pv, image_grid=grid))
    assert not any(p.requires_grad for p in back.vision_model.parameters())


def test_language_model_from_nemotron_h_folder(tmp_path):
    torch.manual_seed(3)
    lm = NemotronHForCausalLM(tiny_config("mixed"))
    lm.save_pretrained(tmp_path / "lm")
    m = build_vlm(language_model_dir=str(tmp_path / "lm"), vision_config={
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "patch_size": 4, "pos_grid": 8, "class_token_len": 1},
        projector_hidden_size=64, image_token_id=IMG)
    for (n, p), (n2, q) in zip(lm.state_dict().items(), m.language_model.state_dict().items()):
        assert n == n2 and torch.equal(p, q)
    ids = torch.randint(0, 200, (1, 8))
    assert torch.equal(m.eval()(ids), lm.eval()(ids))
