"""A second model family, from a package outside hybridtrain (a plain dense Transformer:
tests/families/hybridtrain_dense, found through its entry point), trains through the generic
recipe path: the finetune
recipe in one process, and LoRA under FSDP2 over 2 ranks and under 2 pipeline stages equal to
the single-process run, exporting the adapters (PEFT) and the merged Hugging Face checkpoint."""

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed
from tests.helpers.families import DENSE, DENSE_PREFIXES, require_dense
from tests.helpers.recipes import tiny_recipe

LORA = {"dim": 4, "alpha": 8, "match_all_linear": True}


def _train(layout, world, out_dir):
    """(losses, gradient norms, full weights) of LoRA on the dense family under ``layout``;
    writes the PEFT adapter and the merged HF checkpoint under ``out_dir``."""
    from hybridtrain.peft import export_peft, save_merged_hf

    b, trainer = pu.build(layout, world, peft=LORA, model=DENSE,
                          allowed_target_prefixes=DENSE_PREFIXES)
    losses, norms = pu.train(b, trainer)
    layout = {"layers": len(b.model.model.layers),
              "sharded": all(hasattr(p, "full_tensor") for p in b.model.parameters())}
    export_peft(b.model, out_dir + "/adapter")
    save_merged_hf(b.model, out_dir + "/merged")
    return losses, norms, pu.gather_state(b.model), layout


def _worker(rank, world, layout, out_dir):
    return _train(layout, world, out_dir)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"pp": 2}], ids=["fsdp2", "pp2"])
def test_dense_family_lora_layouts_match_one_process(tmp_path, layout):
    DenseLM = require_dense().DenseLM
    ref_losses, ref_norms, ref_state, _ = _train({}, 1, str(tmp_path / "ref"))
    assert ref_losses[-1] < ref_losses[0]
    res = run_distributed(_worker, 2, layout, str(tmp_path / "run"))
    laid_out = [r[3] for r in res]
    if "pp" in layout:  # two stages of two layers each
        assert [r["layers"] for r in laid_out] == [2, 2]
    else:  # every parameter an FSDP2 shard
        assert all(r["sharded"] for r in laid_out)
    losses, norms, state, _ = res[0]
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) <= 1e-5, (norms, ref_norms)
    assert set(state) == set(ref_state)
    for n, t in ref_state.items():
        torch.testing.assert_close(state[n], t, rtol=0, atol=1e-5, msg=n)
    for f in ("adapter/adapter_model.safetensors", "merged/model.safetensors"):
        ref, got = load_file(str(tmp_path / "ref" / f)), load_file(str(tmp_path / "run" / f))
        assert set(got) == set(ref) and ref
        for k, t in ref.items():
            torch.testing.assert_close(got[k], t, rtol=0, atol=1e-5, msg=f"{f}: {k}")
    # the merged export is the trained model with its adapters folded in
    merged = DenseLM.from_pretrained(str(tmp_path / "run" / "merged"))
    assert not any("lora" in n for n in merged.state_dict())


def test_dense_family_finetune_recipe_exports_hf(tmp_path):
    """``finetune`` in one process trains the family and writes its HF export; the export
    reloads, and equals ``hybridtrain convert`` of the run's checkpoint (read back through the
    family's spec)."""
    from hybridtrain.recipes.finetune import run
    from hybridtrain.training.checkpoint_reader import convert
    DenseLM = require_dense().DenseLM
    out = tmp_path / "run"
    recipe = tiny_recipe(model=DENSE, allowed_target_prefixes=DENSE_PREFIXES,
                         training={"max_steps": 4},
                         checkpoint={"dir": str(out), "save_hf_at_end": True})
    run(recipe)
    exported = sorted(out.glob("step_*/hf/model.safetensors"))
    assert [p.parent.parent.name for p in exported] == ["step_4"]
    convert(str(out), str(tmp_path / "converted"))
    got = load_file(str(exported[0]))
    ref = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert set(got) == set(ref) == set(DenseLM.from_pretrained(str(exported[0].parent)).state_dict())
    for k, t in ref.items():
        assert torch.equal(got[k], t), k
