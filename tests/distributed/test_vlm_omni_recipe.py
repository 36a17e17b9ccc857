"""``examples/vlm_omni_tiny.yaml`` through the finetune recipe's ``run``: a ``nemotron_h_omni``
folder written by transformers, chat JSONL with image content parts. Stage 1 (the projector
alone) exports a folder transformers loads with every tensor, only the projector changed;
stage 2 (``freeze: [vision]``) under ``distributed.encoder_ranks=1`` on 2 ranks logs the
one-process losses."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronH_Omni_Reasoning_V3"):
    pytest.skip("transformers has no nemotron_h_omni", allow_module_level=True)

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "vlm_omni_tiny.yaml")
STEPS = 3


def _finetune(rank, world, tmp, out, *extra):
    from hybridtrain.config.loader import load_config
    from hybridtrain.recipes.finetune import run

    overrides = {"tokenizer.out_dir": f"{tmp}/tokenizer", "model.local_dir.out_dir": f"{tmp}/base",
                 "dataset.path.out_dir": f"{tmp}/train", "dataset.path.n": 48,
                 "validation_dataset.path.out_dir": f"{tmp}/val",
                 "validation_dataset.path.n": 8, "checkpoint.dir": out,
                 "training.max_steps": STEPS, "training.ckpt_every_steps": STEPS,
                 "training.val_every_steps": STEPS, "training.log_every_steps": 1,
                 "training.dtype": "float32",
                 "metrics.progress_bar": False, "metrics.plot": False,
                 "metrics.peak_tflops": 1.0}
    overrides.update(dict(extra))
    return run(load_config(RECIPE, overrides))["checkpoint"]


def _losses(out):
    with open(os.path.join(out, "training.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_stage1_exports_a_folder_transformers_loads(tmp_path):
    torch.set_num_threads(1)
    tmp = str(tmp_path)
    ckpt = _finetune(0, 1, tmp, f"{tmp}/stage1")
    with contextlib.redirect_stderr(io.StringIO()):
        cls = transformers.NemotronH_Omni_Reasoning_V3
        out, info = cls.from_pretrained(f"{ckpt}/hf", output_loading_info=True)
        base = cls.from_pretrained(f"{tmp}/base")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    a, b = out.state_dict(), base.state_dict()
    moved = {k for k in a if not torch.equal(a[k], b[k])}
    assert moved and all(k.startswith("multi_modal_projector.") for k in moved), sorted(moved)


def test_stage2_encoder_ranks_matches_one_process(tmp_path):
    torch.set_num_threads(1)
    tmp = str(tmp_path)
    stage2 = [("model.freeze", ["vision"])]
    _finetune(0, 1, tmp, f"{tmp}/one", *stage2)
    run_distributed(_finetune, 2, tmp, f"{tmp}/hetero", *stage2,
                    ("distributed.encoder_ranks", 1), timeout=250)
    ref, got = _losses(f"{tmp}/one"), _losses(f"{tmp}/hetero")
    assert len(got) == len(ref) == STEPS
    rel = max(abs(x - y) / abs(y) for x, y in zip(got, ref))
    print(f"\n[omni] stage 2, encoder_ranks=1 + 1 lane: losses {got}, max rel diff {rel:.2e}")
    assert rel <= 1e-5
