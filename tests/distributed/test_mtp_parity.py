"""Multi-token prediction trains alike under the layouts it supports: per-step ``loss``,
``mtp_loss`` and gradient norm within 1e-5 of the single process, final weights (the MTP
layers and the routers' correction biases included) within 1e-5 (``tests.helpers.parity``'s
recipe, packed rows, the tiny mixed Nemotron-H with one MTP depth ``*E``): FSDP2, EP, TP,
activation checkpointing, LoRA (the MTP linears adapted), aux-loss-free balancing under
FSDP2 and EP (expert counts summed over the ranks: every rank moves its biases alike).

With the routers' sequence-level balance loss beside (2 steps): EP, TP with sequence
parallelism, context parallelism (a depth's next tokens and targets read across the slice
boundary; the expert counts of whole rows) and pipeline parallelism (the first stage's
embeddings of the tokens ahead carried to the MTP layers on the last; each stage's routers'
part of the balance loss on its own backward), also under the zbv schedule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed

MTP_MODEL = {"config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed",
                        "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}}
LORA = {"dim": 4, "alpha": 8, "match_all_linear": True}  # the MTP linears adapted too
BALANCE = {"moe_bias_update_rate": 0.01}  # the routers' biases move with counts of all ranks
# name: (layout, activation checkpointing, the run's recipe variant)
LAYOUTS = {"fsdp2": ({}, False, "plain"), "ep2": ({"ep": 2}, False, "plain"),
           "fsdp2_ac": ({}, True, "plain"), "fsdp2_lora": ({}, False, "lora"),
           "fsdp2_balance": ({}, False, "balance"), "ep2_balance": ({"ep": 2}, False, "balance"),
           "tp2": ({"tp": 2}, False, "plain"), "ep2_seq_aux": ({"ep": 2}, False, "seq_aux"),
           "tp2_sp_seq_aux": ({"tp": 2, "sp": True}, False, "seq_aux"), "cp2_seq_aux": ({"cp": 2}, False, "seq_aux"),
           # (the first stage holds an MoE layer: layers 0-3)
           "pp2_seq_aux": ({"pp": 2, "split": [4]}, False, "seq_aux"),
           # (the V schedule: the first and last stages on one rank, a zero-bubble backward)
           "pp2_zbv_seq_aux": ({"pp": 2, "schedule": "zbv"}, False, "seq_aux")}
# the routers' sequence-level balance loss beside the MTP loss
SEQ_AUX = {"moe_aux_loss_coeff": 0.01}
VARIANTS = {"plain": {}, "lora": {"peft": LORA}, "balance": {"training": BALANCE},
            "seq_aux": {"training": SEQ_AUX}}
STEPS = {"seq_aux": 2}  # (else pu.STEPS)


def run(layout: dict, world: int, ac=False, variant="plain"):
    b, trainer = pu.build(layout, world, packed=True, ac=ac, model=MTP_MODEL, **VARIANTS[variant])
    recs = [trainer.train_one_step(pu.micro_batches(b, step)) for step in range(STEPS.get(variant, pu.STEPS))]
    # (names without activation checkpointing's wrapper level; the routers' biases included)
    state = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in pu.gather_state(b.model).items()}
    biases = {f"{n}.e_score_correction_bias": r.e_score_correction_bias.clone()
              for n, r in b.model.moe_routers().items()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world > 1:  # (pipeline stages hold different routers)
        parts = [None] * world
        dist.all_gather_object(parts, biases)
        biases = {k: v for part in parts for k, v in part.items()}
    state.update(biases)
    return [(r["loss"], r["mtp_loss"], r["grad_norm"], r["moe_max_load"], r.get("moe_aux_loss", 1.0))
            for r in recs], \
        state if rank == 0 else None


# the layouts that split the model (TP, CP, PP): a process group of their own, on another worker
# under xdist (tests/conftest.py)
MODEL_PARALLEL = {name for name, (layout, _, _) in LAYOUTS.items() if {"tp", "cp", "pp"} & set(layout)}


def _group(rank, world, names):
    out = {}
    for name in names:
        layout, ac, variant = LAYOUTS[name]
        out[name] = run(layout, world, ac, variant)
    return out


@pytest.fixture(scope="module")
def references():
    torch.set_num_threads(1)
    return {v: run({}, 1, variant=v) for v in VARIANTS}


@pytest.fixture(scope="module")
def data_parallel(references):
    return references, run_distributed(_group, 2, sorted(set(LAYOUTS) - MODEL_PARALLEL))[0]


@pytest.fixture(scope="module")
def model_parallel(references):
    return references, run_distributed(_group, 2, sorted(MODEL_PARALLEL))[0]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [name if name not in MODEL_PARALLEL else pytest.param(
    name, marks=pytest.mark.xdist_group("mtp_parity_model_parallel")) for name in LAYOUTS])
def test_mtp_layout_matches_single_process(request, layout):
    refs, res = request.getfixturevalue("model_parallel" if layout in MODEL_PARALLEL else "data_parallel")
    ref_steps, ref_w = refs[LAYOUTS[layout][2]]
    steps, w = res[layout]
    for got, want in zip(steps, ref_steps):
        for g, r in zip(got, want):
            assert abs(g - r) <= 1e-5 * abs(r), (layout, steps, ref_steps)
    assert set(w) == set(ref_w) and any(n.startswith("mtp.") for n in w)
    assert max(float((w[k] - ref_w[k]).abs().max()) for k in ref_w) <= 1e-5
    assert ref_steps[-1][1] > 0
    if LAYOUTS[layout][2] == "balance":  # the biases did move
        assert any(float(w[k].abs().sum()) > 0 for k in w if k.endswith("e_score_correction_bias"))


def _pp_balance(rank, world):
    b, trainer = pu.build({"pp": 2}, world, packed=True, training=BALANCE)
    recs = [trainer.train_one_step(pu.micro_batches(b, step)) for step in range(pu.STEPS)]
    return [(r["loss"], r["moe_max_load"]) for r in recs], _biases(b.model)


def _biases(model) -> dict:
    """The routers' correction biases by their names from ``backbone.`` on (a stage's too)."""
    return {n[n.index("backbone."):]: t.clone() for n, t in model.named_buffers()
            if n.endswith("e_score_correction_bias")}


@pytest.mark.distributed
def test_balancing_under_pipeline_parallelism_sums_the_stages_counts():
    """The tiny mixed model without MTP: each stage's routers move as in one process."""
    torch.set_num_threads(1)
    b, trainer = pu.build({}, 1, packed=True, training=BALANCE)
    ref = [trainer.train_one_step(pu.micro_batches(b, step)) for step in range(pu.STEPS)]
    ref_biases = _biases(b.model)
    held = {}
    for steps, biases in run_distributed(_pp_balance, 2):
        for (loss, load), r in zip(steps, ref):
            assert abs(loss - r["loss"]) <= 1e-5 * r["loss"] and load == r["moe_max_load"]
        held.update(biases)  # (each stage holds its own MoE layers)
    assert set(held) == set(ref_biases) and any(float(v.abs().sum()) > 0 for v in held.values())
    assert all(torch.equal(v, ref_biases[n]) for n, v in held.items())
