"""Training the tiny vision-language model through the recipe's builder and trainer: mixed
image / text-only batches, freezing stages (frozen weights bit-identical, no optimizer state
for a module without trainable parameters), checkpoints."""

import math

import pytest
import torch

from hybridtrain.data.batch import count_label_tokens, model_inputs
from tests.helpers import parity, vlm


@pytest.fixture(scope="module")
def data_dir(vlm_dir):
    return vlm_dir


def test_trains_on_mixed_image_and_text_batches(data_dir):
    b, trainer = vlm.build(data_dir)
    batches = [parity.micro_batches(b, s) for s in range(parity.STEPS)]
    grids = [mb["image_grid"].shape[0] for step in batches for mb in step]
    assert 0 in grids or min(grids) < parity.MBS  # some text-only samples in the batches
    with torch.no_grad():  # the first step's loss: the model's own summed loss, per label token
        total = sum(float(b.model(mb["input_ids"], labels=mb["labels"], **model_inputs(mb)))
                    for mb in batches[0])
    first = total / sum(count_label_tokens(mb) for mb in batches[0])
    losses, norms = parity.train(b, trainer)
    assert losses[0] == pytest.approx(first, rel=1e-6), (losses, first)
    assert all(math.isfinite(x) and x > 0 for x in norms)
    mb = next(mb for step in batches for mb in step if mb["image_grid"].shape[0])
    vision = b.flops_fn(mb) - b.flops_fn({**mb, "image_grid": None})
    assert vision > 0  # the spec counts the vision encoder and projector


@pytest.mark.parametrize("freeze,trained", [
    (["vision", "language"], {"projector"}),           # stage 1: alignment
    (["vision"], {"projector", "language_model"}),     # stage 2: SFT
])
def test_freeze_stages(data_dir, tmp_path, freeze, trained):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    b, trainer = vlm.build(data_dir, freeze=freeze, checkpoint_dir=str(tmp_path / "ck"))
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    parity.train(b, trainer, steps=2)
    for n, p in b.model.named_parameters():
        top = n.split(".")[0]
        if top in trained:
            assert p.requires_grad
        else:
            assert torch.equal(p, before[n]), f"{n} changed although frozen"
    assert any(not torch.equal(p, before[n]) for n, p in b.model.named_parameters()
               if n.startswith("projector."))
    state = get_optimizer_state_dict(b.model, b.optimizer)["state"]
    assert state and {k.split(".")[0] for k in state} == trained
    path = trainer.save_checkpoint()
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(f"{path}/dcp").read_metadata().state_dict_metadata
    optim = {k.split(".")[2] for k in keys if k.startswith("optim.state.")}
    assert optim == trained


def test_resume_matches_uninterrupted(data_dir, tmp_path):
    ref = vlm.reference(data_dir)[0]
    b, trainer = vlm.build(data_dir, checkpoint_dir=str(tmp_path / "ck"))
    first, _ = parity.train(b, trainer, steps=parity.SAVE_AT)
    trainer.save_checkpoint()
    b, trainer = vlm.build(data_dir, checkpoint_dir=str(tmp_path / "ck"))
    trainer.resume(trainer.checkpointer.latest())
    rest, _ = parity.train(b, trainer, start=parity.SAVE_AT, steps=parity.STEPS - parity.SAVE_AT)
    assert first + rest == ref


def test_validation_reports_answer_accuracy(data_dir):
    from hybridtrain.training.builder import build, make_trainer

    recipe = vlm.vlm_recipe(data_dir, training={"val_accuracy": True})
    b = build(recipe, "cpu")
    trainer = make_trainer(b, vlm.build(data_dir)[1].sched, None)
    rec = trainer.validate()
    assert 0.0 <= rec["answer_accuracy"] <= 1.0 and 0.0 <= rec["token_accuracy"] <= 1.0
    assert "answer_accuracy" not in vlm.build(data_dir)[1].validate()


def test_encoder_ranks_refuses_what_it_cannot_place(data_dir):
    from hybridtrain.config import build_config
    from hybridtrain.models.nemotron_vlm.hetero import hetero_plan

    section = build_config({"distributed": {"encoder_ranks": 2, "cp": 2}})["distributed"]
    with pytest.raises(ValueError, match="takes dp_shard / dp_replicate / tp / pp / ep only"):
        hetero_plan(vlm.hetero_model(), section, 4)
    section = build_config({"distributed": {"encoder_ranks": 1, "pp": 2, "dp_shard": 2}}
                           )["distributed"]
    with pytest.raises(ValueError, match="leaves 3 ranks for the language model"):
        hetero_plan(vlm.hetero_model(), section, 4)
    section = build_config({"distributed": {"encoder_ranks": 4}})["distributed"]
    with pytest.raises(ValueError, match="between 1 and 3"):
        hetero_plan(vlm.hetero_model(), section, 4)
    with pytest.raises(ValueError, match="one count must divide the other"):
        from hybridtrain.distributed.bridge import BridgeLayout
        BridgeLayout([0, 1], [2, 3, 4])


def test_nothing_to_train_is_refused(data_dir):
    from hybridtrain.training.builder import build

    recipe = vlm.vlm_recipe(data_dir, freeze=["vision", "projector", "language"])
    with pytest.raises(ValueError, match="no trainable parameters"):
        build(recipe, "cpu", data=False)
