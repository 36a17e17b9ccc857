"""``distributed.encoder_ranks`` with the language model laid out by its own degrees on the other
ranks, through the recipe's builder and trainer: vision encoder + projector on ranks 0..E-1,
the language model pipelined (``pp=2``), FSDP2-sharded (``dp_shard=2``) or expert-parallel
(``ep=2``) over the rest. Three AdamW steps of mixed image / text-only batches match the single
process (``tests.helpers.vlm.assert_run_matches``); a checkpoint of the sharded / pipelined run
resumes colocated and the colocated one resumes under the layout.

The layout of Megatron's heterogeneous training, scaled down: 2 encoder ranks (FSDP2 over them)
beside a language model of tp 2 x ep 2 on 4 ranks, in one process group: a run saving after
step ``SAVE_AT`` matches the single process, resuming from its save gives the same losses bit
for bit, and each rank's parameter, gradient and AdamW-state bytes at its last optimizer step
equal ``hybridtrain plan``'s figures for that rank."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import vlm
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.timeout(600)

SAVE_AT, STEPS = vlm.parity.SAVE_AT, vlm.parity.STEPS
# name -> (encoder ranks, world size, the language model's degrees)
LAYOUTS = {"2+pp2": (2, 4, {"pp": 2}), "1+fsdp2": (1, 3, {"dp_shard": 2}),
           "1+ep2": (1, 3, {"dp_shard": 2, "ep": 2})}


@pytest.fixture(scope="module")
def reference(vlm_dir, vlm_ckpt):
    torch.set_num_threads(1)
    vlm.colocated_checkpoint(vlm_dir, vlm_ckpt)
    return vlm_dir, vlm_ckpt, vlm.reference(vlm_dir)


def _group(rank, world, tmp, ckpt, name, layout):
    path = f"{ckpt}/{name}"
    return {"run": vlm.run(tmp, layout, world),
            "save": vlm.train_and_save(tmp, layout, world, path, SAVE_AT),
            "resume": vlm.resume_and_train(tmp, layout, world, f"{ckpt}/colocated")}


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hetero_language_model_layout(reference, name):
    tmp, ckpt, ref = reference
    enc, world, degrees = LAYOUTS[name]
    layout = {"encoder_ranks": enc, **degrees}
    out = run_distributed(_group, world, tmp, ckpt, name, layout, timeout=500)
    losses, _, _, norms = out[0]["run"]
    assert all(r["run"][0] == losses and r["run"][3] == norms for r in out)  # every rank agrees
    vlm.assert_run_matches(out[0]["run"], ref, name)
    # checkpoints: the layout's resumes colocated, the colocated one resumes under the layout
    assert _rel(out[0]["save"], ref[0][:SAVE_AT]) <= 1e-5
    resumed = vlm.resume_and_train(tmp, None, 1, f"{ckpt}/{name}")
    assert _rel(resumed, ref[0][SAVE_AT:]) <= 1e-5
    assert _rel(out[0]["resume"], ref[0][SAVE_AT:]) <= 1e-5


TP_EP = {"encoder_ranks": 2, "tp": 2, "ep": 2}  # ranks 0-1 encoder; 2-5 language, tp 2 x ep 2


def _run_save_resume(rank, world, tmp, path, layout):
    """A run saved after step ``SAVE_AT`` (and each rank's bytes held at its last optimizer
    step), then a run resumed from that save."""
    from tests.helpers.memory import held_bytes

    b, trainer = vlm.build(tmp, layout, world, checkpoint_dir=path)
    held = []
    if b.optimizer is not None:
        b.optimizer.register_step_pre_hook(lambda opt, *_: held.append(held_bytes(b.model, opt)))
    losses, norms = vlm.parity.train(b, trainer, steps=SAVE_AT)
    trainer.save_checkpoint()
    more = vlm.parity.train(b, trainer, start=SAVE_AT, steps=STEPS - SAVE_AT)
    state = vlm.parity.gather_state(b.model)
    val = trainer.validate()["val_loss"]
    run = (losses + more[0], state if rank == 0 else None, val, norms + more[1])
    return {"run": run, "resumed": vlm.resume_and_train(tmp, layout, world, path),
            "held": held[-1]}


@pytest.mark.xdist_group("vlm_hetero_tp_ep")  # its own process group: beside the others
def test_encoder_fsdp2_beside_tp_ep_language_model(vlm_dir, tmp_path):
    from hybridtrain.training.memory_plan import plan_memory
    from tests.helpers.memory import planned_bytes

    torch.set_num_threads(1)
    ref = vlm.reference(vlm_dir)
    out = run_distributed(_run_save_resume, 6, vlm_dir, str(tmp_path / "tp_ep"), TP_EP,
                          timeout=500)
    losses, _, _, norms = out[0]["run"]
    assert all(r["run"][0] == losses and r["run"][3] == norms for r in out)
    vlm.assert_run_matches(out[0]["run"], ref, "2 + tp2 x ep2")
    assert all(r["resumed"] == losses[SAVE_AT:] for r in out)  # bit for bit
    plan = plan_memory(vlm.vlm_recipe(vlm_dir, TP_EP), 6, device_type="cpu")
    assert [r.role for r in plan.ranks] == ["encoder"] * 2 + ["language model"] * 4
    for rank, r in enumerate(out):
        assert r["held"] == {k: int(v) for k, v in planned_bytes(plan, rank).items()}, rank
