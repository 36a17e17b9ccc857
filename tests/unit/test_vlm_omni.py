"""transformers' ``nemotron_h_omni`` (RADIO + pixel-shuffle projector + Nemotron-H) in and out:
logits and loss parity (fp32) with transformers on tiny random models it writes itself, images
of several sizes and aspect ratios from its own image processor, text-only rows and several
images in a row; the export loads back into transformers with every tensor."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronH_Omni_Reasoning_V3"):
    pytest.skip("transformers has no nemotron_h_omni", allow_module_level=True)

from hybridtrain.models.nemotron_vlm import build_vlm  # noqa: E402
from hybridtrain.models.nemotron_vlm.tiny_omni import write_tiny_omni  # noqa: E402

IMAGE = 4
# patch grids (rows, cols) as the image processor makes them (even sides, 16..64 patches, the
# aspect kept): square at the position grid's size (8x8), wide (beyond it: interpolated up),
# tall, the smallest, and large
SIZES = [(8, 8), (4, 14), (12, 6), (4, 4), (10, 6)]


def hf_omni(path):
    with contextlib.redirect_stderr(io.StringIO()):
        model, info = transformers.NemotronH_Omni_Reasoning_V3.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys",
                                                               "mismatched_keys")}
    assert not problems, f"transformers did not load every tensor: {problems}"
    model.config.text_config._attn_implementation = "eager"
    return model.eval()


def processed(grids, seed=0):
    """(pixel_values [patches, 3 * 4 * 4], image_grid_hw) of random normalised images."""
    g = torch.Generator().manual_seed(seed)
    grids = torch.tensor(grids)
    return torch.randn(int(grids.prod(-1).sum()), 48, generator=g), grids


def batch(grids, rows_images, length=40, seed=1):
    """input_ids [B, L]: row b holds the placeholders of its images (rows_images[b] of them,
    in order), then text; labels the next tokens."""
    g = torch.Generator().manual_seed(seed)
    per_image = [int(h * w // 4) for h, w in grids.tolist()]
    rows, k = [], 0
    for n in rows_images:
        ids = []
        for _ in range(n):
            ids += [5] + [IMAGE] * per_image[k] + [6]
            k += 1
        ids += torch.randint(7, 320, (length - len(ids),), generator=g).tolist()
        rows.append(ids)
    width = max(map(len, rows))
    ids = torch.tensor([r + [7] * (width - len(r)) for r in rows])
    labels = torch.cat([ids[:, 1:], torch.full((len(rows), 1), -100)], 1)
    labels[labels == IMAGE] = -100
    return ids, labels


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    return write_tiny_omni(tmp_path_factory.mktemp("omni") / "tiny", seed=0)


CASES = {"one image per row, 2 rows": ([0, 1], [1, 1]),
         "several images in a row + a text-only row": ([0, 1, 2], [2, 0, 1]),
         "small upscaled, large, tall": ([3, 4, 2], [1, 2])}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_loss_match_transformers(omni_dir, case):
    which, rows_images = CASES[case]
    pixels, grids = processed([SIZES[i] for i in which])
    ids, labels = batch(grids, rows_images)
    ours = build_vlm(local_dir=omni_dir)
    ref = hf_omni(omni_dir)
    with torch.no_grad():
        a = ours(ids, pixel_values=pixels, image_grid=grids)
        loss_a = ours(ids, pixel_values=pixels, image_grid=grids, labels=labels)
        out = ref(input_ids=ids, pixel_values=pixels, image_grid_hw=grids, use_cache=False)
        hf_labels = torch.cat([torch.full((ids.shape[0], 1), -100), labels[:, :-1]], 1)
        loss_b = ref(input_ids=ids, pixel_values=pixels, image_grid_hw=grids,
                     labels=hf_labels, use_cache=False).loss
    diff = (a - out.logits).abs().max().item()
    print(f"\n[omni parity] {case}: grids {grids.tolist()} max|logits diff| = {diff:.2e}, "
          f"loss {loss_a.item():.6f} vs {loss_b.item():.6f}")
    assert diff <= 1e-4
    assert abs(loss_a.item() - loss_b.item()) <= 1e-4


def test_text_only_batch_and_mtp_vision_norm(tmp_path):
    """A checkpoint whose language model has MTP layers (transformers then normalises the ViT's
    output) and a batch without images."""
    path = write_tiny_omni(tmp_path / "mtp", seed=3, mtp=True)
    ours, ref = build_vlm(local_dir=path), hf_omni(path)
    assert ours.vision_model.norm is not None
    pixels, grids = processed([SIZES[1]])
    ids, _ = batch(grids, [1])
    text, _ = batch(grids[:0], [0, 0])
    with torch.no_grad():
        for kw in (dict(pixel_values=pixels, image_grid=grids), {}):
            x = ids if kw else text
            a = ours(x, **kw)
            b = ref(input_ids=x, use_cache=False, **({"pixel_values": pixels,
                                                       "image_grid_hw": grids} if kw else {})).logits
            assert (a - b).abs().max().item() <= 1e-4


def test_export_loads_back_into_transformers(omni_dir, tmp_path):
    """Trained a step, saved: transformers loads every tensor, and computes our logits."""
    ours = build_vlm(local_dir=omni_dir)
    pixels, grids = processed([SIZES[0], SIZES[1]])
    ids, labels = batch(grids, [2])
    opt = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.1)
    ours.train()
    ours(ids, pixel_values=pixels, image_grid=grids, labels=labels).backward()
    opt.step()
    ours.eval()
    ours.save_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "nemotron_h_omni"
    ref = hf_omni(tmp_path / "out")
    with torch.no_grad():
        a = ours(ids, pixel_values=pixels, image_grid=grids)
        b = ref(input_ids=ids, pixel_values=pixels, image_grid_hw=grids, use_cache=False).logits
    assert (a - b).abs().max().item() <= 1e-4
    again = build_vlm(local_dir=tmp_path / "out")
    for (n, x), (_, y) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(x, y), n


def test_audio_encoder_carried_frozen_to_the_export(tmp_path):
    """A checkpoint with an audio encoder: its tensors ride along, unchanged, into an export
    transformers loads with every tensor; the vision-language logits still match."""
    path = write_tiny_omni(tmp_path / "audio", seed=4, audio=True)
    ours, ref = build_vlm(local_dir=path), hf_omni(path)
    carried = {n for n, _ in ours.named_buffers() if ".carried." in n}
    assert carried and not any(".carried." in n for n, _ in ours.named_parameters())
    pixels, grids = processed([SIZES[2]])
    ids, _ = batch(grids, [1])
    with torch.no_grad():
        a = ours(ids, pixel_values=pixels, image_grid=grids)
        b = ref(input_ids=ids, pixel_values=pixels, image_grid_hw=grids, use_cache=False).logits
    assert (a - b).abs().max().item() <= 1e-4
    ours.save_pretrained(tmp_path / "out")
    back = hf_omni(tmp_path / "out")
    for (n, x), (_, y) in zip(ref.state_dict().items(), back.state_dict().items()):
        if n.startswith(("audio_tower.", "embed_audio.")):
            assert torch.equal(x, y), n


def test_legacy_field_names_and_audio_refusal(omni_dir, tmp_path):
    from hybridtrain.models.nemotron_vlm.config import NemotronVLMConfig
    d = json.loads(open(f"{omni_dir}/config.json").read())
    legacy = dict(d)
    legacy["llm_config"] = legacy.pop("text_config")
    legacy["img_context_token_id"] = legacy.pop("image_token_id")
    legacy["vit_hidden_size"] = legacy.pop("vision_hidden_size")
    cfg = NemotronVLMConfig.from_dict(legacy)
    assert cfg.image_token_id == IMAGE and cfg.text_config.vocab_size == 320
    with pytest.raises(ValueError, match="load the folder"):
        NemotronVLMConfig.from_dict({**d, "sound_config": {"hidden_size": 8}})
