"""Every parallel layout trains like the single process: the parity matrix.

The recipe's own builder and trainer (``tests.helpers.parity``): tiny MoE Nemotron-H with all
four layer types, 3 AdamW steps of ``Trainer.train_one_step``, global batch 8 (micro-batch 2),
unpacked and packed rows. For each layout: per-step losses and gradient norms within 1e-5
relative of the single-process run (the same builder, one process), final weights within 1e-5,
validation loss (``Trainer.validate``) within 1e-5. Layouts that fit in two ranks run in one
process group, the four-rank ones in another (on another worker under xdist). Checkpoints (the
trainer's save and resume) cross layouts: FSDP2 -> {PP, single}, PP -> {FSDP2, single}.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed

LAYOUTS_2 = {
    "fsdp2": {},
    "ep2": {"ep": 2},
    "pp2_1f1b": {"pp": 2},
    "pp2_interleaved": {"pp": 2, "schedule": "interleaved1f1b"},
    "pp2_gpipe": {"pp": 2, "schedule": "gpipe"},
    "pp2_zbv": {"pp": 2, "schedule": "zbv"},
}
LAYOUTS_4 = {
    "hsdp2x2": {"dp_replicate": 2},
    "pp2_ep2": {"pp": 2, "ep": 2},
}
SAVE_AT = pu.SAVE_AT
PADDING_FREE = {"padding_free": True}
# packed rows without their padding: ranks run micro-batches of different lengths (data
# parallel, expert exchange), or split one row of any length (sequence parallel, context parallel)
PADDING_FREE_LAYOUTS = {"fsdp2": {}, "ep2": {"ep": 2}, "tp2_sp": {"tp": 2, "sp": True}, "cp2": {"cp": 2}}
UNEVEN_DOCS = {"min_len": 6, "max_len": 7}  # two to a packed row of 16 tokens: 2-4 left over


def _group(rank, world, layouts, ckpt_dir):
    out = {}
    for name, layout in layouts.items():
        for packed in (False, True):
            out[(name, packed)] = pu.run_layout(layout, world, packed)
    if ckpt_dir is None:
        return out
    for name, layout in PADDING_FREE_LAYOUTS.items():
        out[(name, "padding_free")] = pu.run_layout(layout, world, True, packing=PADDING_FREE, dataset=UNEVEN_DOCS)
    # activation checkpointing changes nothing (bitwise)
    out[("fsdp2_ac", False)] = pu.run_layout({}, world, False, ac=2)
    # checkpoints across layouts
    out["save_fsdp2"] = pu.train_and_save({}, world, f"{ckpt_dir}/fsdp2", SAVE_AT)
    out["save_pp2"] = pu.train_and_save({"pp": 2}, world, f"{ckpt_dir}/pp2", SAVE_AT)
    out["fsdp2->pp2"] = pu.resume_and_train({"pp": 2}, world, f"{ckpt_dir}/fsdp2")
    out["pp2->fsdp2"] = pu.resume_and_train({}, world, f"{ckpt_dir}/pp2")
    return out


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return {packed: pu.reference(packed) for packed in (False, True)}


@pytest.fixture(scope="module")
def matrix(reference, tmp_path_factory):
    """The two-rank layouts, activation checkpointing and the checkpoints across layouts."""
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    res = run_distributed(_group, 2, LAYOUTS_2, ckpt)[0]
    # single-process resumes of the distributed checkpoints
    for src in ("fsdp2", "pp2"):
        res[f"{src}->single"] = pu.resume_and_train({}, 1, f"{ckpt}/{src}")
    return reference, res


@pytest.fixture(scope="module")
def matrix4(reference):
    """The four-rank layouts (their own process group, on a worker of its own under xdist)."""
    return reference, run_distributed(_group, 4, LAYOUTS_4, None)[0]


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def max_weight_diff(w, ref):
    assert set(w) == set(ref)
    return max(float((w[k] - ref[k]).abs().max()) for k in ref)


def assert_matches(run, ref, label: str) -> None:
    """Per-step losses and gradient norms within 1e-5 relative, final weights within 1e-5,
    validation loss within 1e-5 relative."""
    ref_losses, ref_w, ref_val, ref_norms = ref
    losses, w, val, norms = run
    assert all(math.isfinite(x) for x in losses)
    rel = max_rel(losses, ref_losses)
    rel_norm = max_rel(norms, ref_norms)  # Adam hides a scaled gradient; the norm does not
    dw = max_weight_diff(w, ref_w)
    print(f"{label:26s} loss rel {rel:.2e} grad-norm rel {rel_norm:.2e} weights abs {dw:.2e} "
          f"val rel {abs(val - ref_val) / ref_val:.2e}")
    assert rel <= 1e-5, (losses, ref_losses)
    assert rel_norm <= 1e-5, (norms, ref_norms)
    assert dw <= 1e-5
    assert abs(val - ref_val) <= 1e-5 * ref_val


@pytest.mark.distributed
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("layout", [
    *LAYOUTS_2, *(pytest.param(name, marks=pytest.mark.xdist_group("parity_4_ranks")) for name in LAYOUTS_4)])
def test_layout_matches_single_process(request, layout, packed):
    ref, res = request.getfixturevalue("matrix4" if layout in LAYOUTS_4 else "matrix")
    assert_matches(res[(layout, packed)], ref[packed], f"{layout} {'packed' if packed else 'unpacked'}")


def test_padding_free_recipe_feeds_one_row_of_documents():
    """The recipe key reaches the loader: each micro-batch of the padded rows' documents is one
    row, shorter than the padded rows together, with no pad token in it."""
    b, _ = pu.build({}, 1, True, packing=PADDING_FREE, dataset=UNEVEN_DOCS)
    for mb in pu.micro_batches(b, 0):
        rows, T = mb["input_ids"].shape
        assert rows == 1 and T < pu.MBS * pu.SEQ
        assert int(mb["attention_mask"].sum()) == T == int(mb["num_tokens"])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(PADDING_FREE_LAYOUTS))
def test_padding_free_packed_rows_match_single_process(matrix, layout):
    """Packed rows joined without their padding (``packing.padding_free``): each layout against
    the single process run the same way, and that one against the padded rows' run (the same
    documents, so the same losses up to rounding)."""
    _, res = matrix
    alone = pu.reference(True, packing=PADDING_FREE, dataset=UNEVEN_DOCS)
    assert_matches(alone, pu.reference(True, dataset=UNEVEN_DOCS), "single padding_free vs padded")
    assert_matches(res[(layout, "padding_free")], alone, f"{layout} padding_free")


@pytest.mark.distributed
def test_activation_checkpointing_is_exact(matrix):
    _, res = matrix
    assert res[("fsdp2_ac", False)][0] == res[("fsdp2", False)][0]


@pytest.mark.distributed
@pytest.mark.parametrize("flow", ["fsdp2->pp2", "pp2->fsdp2", "fsdp2->single", "pp2->single"])
def test_checkpoint_resumes_across_layouts(matrix, flow):
    ref, res = matrix
    ref_losses = ref[False][0]
    src = flow.split("->")[0]
    assert max_rel(res[f"save_{src}"], ref_losses[:SAVE_AT]) <= 1e-5
    assert max_rel(res[flow], ref_losses[SAVE_AT:]) <= 1e-5, (res[flow], ref_losses[SAVE_AT:])
