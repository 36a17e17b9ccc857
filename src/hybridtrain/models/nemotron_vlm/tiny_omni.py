"""A tiny random ``nemotron_h_omni`` checkpoint written by transformers itself (the suite's
parity reference and ``examples/vlm_omni_tiny.yaml``'s model)::

    python -m hybridtrain.models.nemotron_vlm.tiny_omni OUT_DIR [--seed 0]

RADIO ViT (width 32, 2 blocks, 4-pixel patches, 2 class tokens + 3 registers, a 8x8 position
grid), projector width 48, the tiny 'mixed' Nemotron-H (``M*-EM*E``, vocab 320); the image
placeholder is token 4 (``<image>`` of ``examples/vlm_omni_tiny.yaml``'s tokenizer).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil

import torch

from hybridtrain.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM, tiny_config
from hybridtrain.models.nemotron_h.hf_io import hub_tensors


def tiny_omni_hf_config(image_token_id: int = 4, vocab_size: int = 320, mtp: bool = False,
                        audio: bool = False, **vision: int):
    """transformers' ``NemotronH_Omni_Reasoning_V3_Config`` of the tiny model (``mtp``: one
    MTP depth, so transformers builds the norm after the ViT, its tensors added by
    :func:`write_tiny_omni`; ``audio``: a one-layer Parakeet
    audio encoder, token 7 its placeholder)."""
    import transformers
    if not hasattr(transformers, "NemotronH_Omni_Reasoning_V3_Config"):
        raise ValueError(f"transformers {transformers.__version__} has no nemotron_h_omni "
                         "model; install transformers>=5.25")
    text = tiny_config("mixed", vocab_size=vocab_size).to_hf_dict()
    if mtp:
        text["num_nextn_predict_layers"] = 1
    v = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
             max_img_size=32, num_cls_tokens=2, num_registers=3, video_temporal_patch_size=2)
    v.update(vision)
    sound = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                 subsampling_conv_channels=8, num_mel_bins=16, projection_hidden_size=24,
                 projection_bias=False) if audio else None
    return transformers.NemotronH_Omni_Reasoning_V3_Config(
        text_config=text, vision_config=v, audio_config=sound, projector_hidden_size=48,
        vision_hidden_size=v["hidden_size"], image_token_id=image_token_id,
        audio_token_id=7 if audio else None)


def write_tiny_omni(out_dir: str | os.PathLike, seed: int = 0, overwrite: bool = True,
                    **config) -> str:
    """Write the tiny model (random weights of ``seed``; layer scales and norms perturbed so
    that every tensor matters) with transformers' ``save_pretrained``; returns ``out_dir``.
    Written next to ``out_dir`` and renamed into place, so that ranks writing it at once do not
    mix files; ``overwrite=False`` keeps a folder already there."""
    import transformers
    out_dir = os.fspath(out_dir)
    if not overwrite and os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    torch.manual_seed(seed)
    # on the CPU even where the caller builds models on the meta device
    with contextlib.redirect_stderr(io.StringIO()), torch.device("cpu"):
        model = transformers.NemotronH_Omni_Reasoning_V3(tiny_omni_hf_config(**config))
    with torch.no_grad(), torch.device("cpu"):
        for name, p in model.named_parameters():
            if "lambda1" in name or "norm" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    if model.config.text_config.num_nextn_predict_layers:
        _add_mtp_tensors(tmp, model.config.text_config.to_dict())
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir, ignore_errors=True)
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process put it there first (same seed, same files)
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _add_mtp_tensors(folder: str, text: dict) -> None:
    """Random multi-token-prediction layers (``language_model.mtp.*``), as released
    checkpoints carry them: transformers neither builds nor saves them."""
    from safetensors.torch import load_file, save_file

    config = NemotronHConfig.from_dict(text, source="text_config")
    with torch.device("cpu"):
        lm = NemotronHForCausalLM(config)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors.update({f"language_model.{n}": t.contiguous()
                    for n, t in hub_tensors(lm.state_dict(), config) if n.startswith("mtp.")})
    save_file(tensors, path, metadata={"format": "pt"})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(write_tiny_omni(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
