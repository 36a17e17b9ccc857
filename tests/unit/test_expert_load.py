"""The MoE routers' load per step (moe_max_load, moe_idle_experts) and the aux-loss-free
correction-bias update: its rule, that rate 0 changes nothing, that a block recomputed under
activation checkpointing counts once, that the export carries the bias and resume is exact."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from hybridtrain.ops.expert_load import ExpertLoad
from tests.helpers import parity as pu


def test_metrics_and_the_sign_update_rule():
    biases = {"a": torch.zeros(4), "b": torch.ones(4)}
    load = ExpertLoad(["a", "b"], 4, lambda: biases, rate=0.5)
    table = torch.tensor([[6, 2, 0, 0], [2, 2, 2, 2]])
    rec = load.record(table)
    assert rec["moe_max_load"] == 6 * 4 / 8 and rec["moe_max_load_layer"] == "a"
    assert rec["moe_idle_experts"] == (0.5 + 0.0) / 2
    load.update_biases(table)
    assert biases["a"].tolist() == [-0.5, 0.0, 0.5, 0.5]  # mean 2: toward the idle experts
    assert biases["b"].tolist() == [1.0] * 4  # balanced: unchanged


def _biases(model):
    return {n: r.e_score_correction_bias.clone() for n, r in model.moe_routers().items()}


def _steps(steps=2, **training):
    b, trainer = pu.build({}, 1, packed=True, training=training)
    recs = [trainer.train_one_step(pu.micro_batches(b, s)) for s in range(steps)]
    return b, recs


def test_rate_zero_changes_nothing_and_checkpointed_blocks_count_once():
    b, recs = _steps()
    assert all(float(v.abs().sum()) == 0 for v in _biases(b.model).values())
    assert recs[0]["moe_max_load"] >= 1.0 and 0 <= recs[0]["moe_idle_experts"] < 1
    _, ac = _steps(activation_checkpointing=True)
    assert [r["loss"] for r in ac] == [r["loss"] for r in recs]
    assert [r["moe_max_load"] for r in ac] == [r["moe_max_load"] for r in recs]


def test_balancing_moves_the_biases_the_export_carries_them_and_resume_is_exact(tmp_path):
    b, trainer = pu.build({}, 1, packed=True, training={"moe_bias_update_rate": 0.01},
                          checkpoint_dir=str(tmp_path / "run"))
    recs = [trainer.train_one_step(pu.micro_batches(b, 0))]
    trainer.save_checkpoint()
    recs += [trainer.train_one_step(pu.micro_batches(b, s)) for s in (1, 2)]
    final = _biases(b.model)
    assert all(float(v.abs().sum()) > 0 for v in final.values())
    assert all(set(v.abs().unique().tolist()) <= {0.0, 0.01, 0.02, 0.03}
               for v in (x.double().round(decimals=6) for x in final.values()))

    b2, resumed = pu.build({}, 1, packed=True, training={"moe_bias_update_rate": 0.01},
                           checkpoint_dir=str(tmp_path / "run"))
    resumed.resume(resumed.checkpointer.latest())
    again = [resumed.train_one_step(pu.micro_batches(b2, s)) for s in (1, 2)]
    assert [r["loss"] for r in again] == [r["loss"] for r in recs[1:]]
    assert all(torch.equal(v, final[n]) for n, v in _biases(b2.model).items())

    resumed.checkpointer.export(b2.model, str(tmp_path / "out"), final=True)
    hf = next((tmp_path / "out").glob("**/config.json")).parent
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        for name, bias in final.items():
            assert torch.equal(f.get_tensor(f"{name}.mixer.gate.e_score_correction_bias"), bias)
    assert json.loads((hf / "config.json").read_text())["model_type"] == "nemotron_h"


def test_sequence_balance_loss_is_the_per_row_sum_of_f_times_p():
    from hybridtrain.models.nemotron_h.moe import sequence_balance_loss

    g = torch.Generator().manual_seed(0)
    rows, L, E, k = 3, 5, 6, 2
    logits = torch.randn(rows * L, E, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows * L)])
    want = 0.0
    for b in range(rows):
        s = logits[b * L:(b + 1) * L].sigmoid()
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        for i in range(E):
            f = E / (k * L) * int((idx[b * L:(b + 1) * L] == i).sum())
            want += f * float(p[i])
    assert abs(float(sequence_balance_loss(logits, idx, rows)) - want) < 1e-5


def test_the_sequence_balance_loss_reaches_the_gradient_with_its_coefficient():
    from hybridtrain.data.batch import IGNORE_INDEX
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM
    from hybridtrain.models.nemotron_h.mtp_training import setup_aux_losses
    from hybridtrain.models.nemotron_h.tiny import tiny_config
    from hybridtrain.ops.loss import LinearCrossEntropy
    from hybridtrain.training.settings import trainer_settings

    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_config("moe"))
    model.loss = LinearCrossEntropy(reduction="sum")
    aux = setup_aux_losses(model, trainer_settings({"moe_aux_loss_coeff": 0.5}).training)
    ids = torch.randint(3, 256, (3, 10))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], 1)
    n = int((labels != IGNORE_INDEX).sum())
    aux.begin_step(aux.counts({"labels": labels}))
    (model(ids, labels=labels) / n).backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    rec = aux.record(aux.step_sums("cpu"), torch.tensor([3.0]))
    aux.end_step()
    model.zero_grad()
    main = model(ids, labels=labels)  # no step begun: the routers still compute their losses
    seq = sum(r.last_seq_aux for r in model.moe_routers().values())
    (main / n + 0.5 * seq / 3).backward()
    assert abs(rec["moe_aux_loss"] - float(seq.detach()) / 3) < 1e-6
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert got["backbone.layers.1.mixer.gate.weight"].abs().sum() > 0
