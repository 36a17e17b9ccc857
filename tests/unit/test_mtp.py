"""Multi-token prediction (MTP) layers: the Hub layout, load/save byte-identical, the meta
build and sliced load, the training objective's targets and gradient, and the recipe's
train / freeze / drop choice."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from hybridtrain.data.batch import IGNORE_INDEX
from hybridtrain.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from hybridtrain.models.nemotron_h.blocks import Block, SequenceInfo
from hybridtrain.models.nemotron_h.model import seq_idx_from_cu_seqlens
from hybridtrain.models.nemotron_h.mtp import depth_labels
from hybridtrain.models.nemotron_h.mtp_training import depth_counts, setup_aux_losses
from hybridtrain.models.nemotron_h.tiny import tiny_config
from hybridtrain.ops.loss import LinearCrossEntropy
from hybridtrain.training.settings import trainer_settings
from tests.helpers import parity as pu


def mtp_config(pattern: str = "*E", depths: int = 1, **kw) -> NemotronHConfig:
    return tiny_config("moe", num_nextn_predict_layers=depths, mtp_hybrid_override_pattern=pattern, **kw)


def test_hub_layout_of_the_mtp_layers():
    model = NemotronHForCausalLM(mtp_config("*E", depths=2))
    names = {n for n in model.state_dict() if n.startswith("mtp.")}
    for first in (0, 2):  # each depth's first layer fuses, its last one norms
        assert {f"mtp.layers.{first}.{p}.weight" for p in ("enorm", "hnorm", "eh_proj")} <= names
        assert f"mtp.layers.{first + 1}.final_layernorm.weight" in names
        assert f"mtp.layers.{first}.mixer.q_proj.weight" in names
        assert f"mtp.layers.{first + 1}.mixer.gate.e_score_correction_bias" in names
    assert model.mtp.layers["0"].eh_proj.weight.shape == (64, 128)
    assert not any(n.startswith(("mtp.layers.1.enorm", "mtp.layers.0.final_layernorm")) for n in names)


def test_config_reads_both_spellings_and_writes_both():
    legacy = mtp_config("*E").to_hf_dict()
    assert legacy["mtp_layers_block_type"] == ["full_attention", "moe"]
    assert legacy["mtp_hybrid_override_pattern"] == "*E"
    listed = dict(legacy, mtp_layers_block_type=["attention", "moe"])
    del listed["mtp_hybrid_override_pattern"]
    assert NemotronHConfig.from_dict(listed).mtp_hybrid_override_pattern == "*E"
    with pytest.raises(ValueError, match="mtp_hybrid_override_pattern.*disagrees"):
        NemotronHConfig.from_dict(dict(legacy, mtp_hybrid_override_pattern="M-"))
    with pytest.raises(ValueError, match="mtp_hybrid_override_pattern.*unknown layer character"):
        NemotronHConfig.from_dict({**listed, "mtp_hybrid_override_pattern": "*X",
                                   "mtp_layers_block_type": None})


@pytest.mark.parametrize("pattern,depths", [("*E", 1), ("M-", 2)])
def test_checkpoint_with_mtp_round_trips_byte_identical(tmp_path, pattern, depths):
    torch.manual_seed(0)
    NemotronHForCausalLM(mtp_config(pattern, depths)).save_pretrained(tmp_path / "a", max_shard_size="200KB")
    loaded = NemotronHForCausalLM.from_pretrained(tmp_path / "a")
    loaded.save_pretrained(tmp_path / "b", max_shard_size="200KB")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir()) and len(files) > 3
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = [n for n in index if n.startswith("mtp.layers.")]
    per_depth = {"*E": 8 + 2 * 8 + 6, "M-": 7 + 3 + 2 + 3}[pattern]  # (experts unstacked)
    assert len(mtp) >= depths * per_depth - 8 and f"mtp.layers.{2 * depths - 1}.final_layernorm.weight" in mtp


def test_meta_build_and_sliced_load_cover_the_mtp_layers(tmp_path):
    from hybridtrain.distributed.materialize import materialize
    from hybridtrain.models.nemotron_h.hf_io import slice_reader

    torch.manual_seed(0)
    ref = NemotronHForCausalLM(mtp_config("*E"))
    ref.save_pretrained(tmp_path)
    meta = NemotronHForCausalLM.from_pretrained(tmp_path, device="meta")
    assert any(n.startswith("mtp.") for n, _ in meta.named_parameters())
    materialize(meta, "cpu", read=slice_reader(tmp_path), read_names=meta.state_dict())
    got, want = meta.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_depth_targets_stay_in_their_document_and_keep_the_mask():
    # two packed documents [0..4] and [5..9] in one row; position 2's label is masked
    labels = torch.tensor([[11, 12, IGNORE_INDEX, 14, IGNORE_INDEX, 16, 17, 18, 19, IGNORE_INDEX]])
    seq_idx = torch.tensor([[0] * 5 + [1] * 5])
    d1 = depth_labels(labels, 1, seq_idx)
    assert d1.tolist() == [[12, IGNORE_INDEX, 14, IGNORE_INDEX, IGNORE_INDEX,
                            17, 18, 19, IGNORE_INDEX, IGNORE_INDEX]]
    d2 = depth_labels(labels, 2, seq_idx)
    assert d2.tolist() == [[IGNORE_INDEX, 14, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX,
                            18, 19, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    batch = {"labels": labels, "cu_seqlens": torch.tensor([0, 5, 10], dtype=torch.int32)}
    assert depth_counts(batch, 2).tolist() == [5.0, 3.0]


def _reference_mtp_sums(model, ids, labels, cu_seqlens, depths):
    """Each depth's CE sum, written out position by position from the modules."""
    docs = torch.zeros(ids.numel(), dtype=torch.long)
    docs[cu_seqlens[1:-1].long()] = 1
    docs = docs.cumsum(0).view_as(ids)
    hidden = model.hidden_states(ids, cu_seqlens=cu_seqlens)
    sums = []
    for d in range(depths):
        nxt = torch.cat([ids[:, d + 1:], torch.zeros_like(ids[:, :d + 1])], 1)
        x = model.mtp.layers[str(2 * d)].fuse(hidden, model.backbone.embeddings(nxt))
        info = SequenceInfo(seq_idx=seq_idx_from_cu_seqlens(cu_seqlens, *ids.shape))
        for j in range(2):  # the layers' residual blocks, without the fusion / final norm
            x = Block.forward(model.mtp.layers[str(2 * d + j)], x, info)
        hidden = model.mtp.layers[str(2 * d + 1)].final_layernorm(x)
        logits = model.lm_head(hidden).float()
        total = 0.0
        L = ids.shape[1]
        for b in range(ids.shape[0]):
            for t in range(L - d - 1):
                tgt = labels[b, t + d + 1]
                if docs[b, t + d + 1] == docs[b, t] and tgt != IGNORE_INDEX:
                    total = total + F.cross_entropy(logits[b, t][None], tgt[None], reduction="sum")
        sums.append(total)
    return sums


def test_mtp_gradient_is_the_weighted_depth_mean_and_the_loss_value_stays_the_lm_loss():
    torch.manual_seed(0)
    depths, scale = 2, 0.3
    model = NemotronHForCausalLM(mtp_config("*E", depths))
    model.loss = LinearCrossEntropy(reduction="sum")
    ids = torch.randint(3, 256, (2, 12))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], 1)
    labels[0, 2:4] = IGNORE_INDEX  # a prompt
    labels[0, 6] = labels[1, 4] = IGNORE_INDEX  # ends of packed documents
    cu = torch.tensor([0, 7, 12, 17, 24], dtype=torch.int32)
    batch = {"input_ids": ids, "labels": labels, "cu_seqlens": cu}
    settings = trainer_settings({"mtp_loss_scale": scale}).training
    aux = setup_aux_losses(model, settings)
    counts = aux.counts(batch)
    n_main = int((labels != IGNORE_INDEX).sum())

    main_only = model(ids, labels=labels, cu_seqlens=cu)  # no step begun: the LM loss alone
    aux.begin_step(counts)
    loss = model(ids, labels=labels, cu_seqlens=cu)
    assert torch.equal(loss, main_only)
    (loss / n_main).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    sums = aux.step_sums("cpu")
    aux.end_step()

    model.zero_grad()
    ref_sums = _reference_mtp_sums(model, ids, labels, cu, depths)
    ref = model(ids, labels=labels, cu_seqlens=cu) / n_main + sum(
        scale / depths * s / c for s, c in zip(ref_sums, counts))
    ref.backward()
    torch.testing.assert_close(sums, torch.stack([s.detach() for s in ref_sums]).double(), rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert got["mtp.layers.2.eh_proj.weight"].abs().sum() > 0


def _built(mtp: str, tmp_path=None):
    model = {"config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed",
                        "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}}
    return pu.build({}, 1, packed=True, model=model, training={"mtp": mtp}, checkpoint_dir=tmp_path)


def test_training_logs_mtp_loss_and_trains_the_mtp_layers():
    b, trainer = _built("train")
    before = b.model.mtp.layers["0"].eh_proj.weight.detach().clone()
    rec = trainer.train_one_step(pu.micro_batches(b, 0))
    assert rec["mtp_loss"] == rec["mtp_loss_1"] and rec["mtp_loss"] > 0
    assert not torch.equal(before, b.model.mtp.layers["0"].eh_proj.weight)


def test_freeze_keeps_and_drop_removes_the_mtp_layers(tmp_path, caplog):
    b, trainer = _built("freeze")
    before = {n: p.detach().clone() for n, p in b.model.named_parameters() if n.startswith("mtp.")}
    rec = trainer.train_one_step(pu.micro_batches(b, 0))
    assert "mtp_loss" not in rec and before
    assert all(torch.equal(p, before[n]) for n, p in b.model.named_parameters() if n in before)

    with caplog.at_level("WARNING"):
        b, trainer = _built("drop", str(tmp_path))
    assert "training.mtp=drop" in caplog.text
    assert b.model.mtp is None and b.model.config.num_nextn_predict_layers == 0
    trainer.train_one_step(pu.micro_batches(b, 0))
    trainer.checkpointer.export(b.model, str(tmp_path / "out"), final=True)
    hf = next(tmp_path.glob("out/**/config.json")).parent
    assert json.loads((hf / "config.json").read_text())["num_nextn_predict_layers"] == 0
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("mtp.") for k in f.keys())


def test_lora_adapts_the_mtp_linears_and_their_loss_trains_them(tmp_path):
    model = {"config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed",
                        "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}}
    b, trainer = pu.build({}, 1, packed=True, model=model, checkpoint_dir=str(tmp_path),
                          peft={"dim": 4, "alpha": 8, "match_all_linear": True})
    adapters = {n: p for n, p in b.model.named_parameters() if n.startswith("mtp.") and "lora_B" in n}
    assert any(".eh_proj." in n for n in adapters) and any(".q_proj." in n for n in adapters)
    assert all(p.requires_grad for p in adapters.values())
    rec = trainer.train_one_step(pu.micro_batches(b, 0))
    assert rec["mtp_loss"] > 0
    assert any(p.abs().sum() > 0 for p in adapters.values())  # B starts at zero


def test_super_config_builds_the_hub_checkpoint_s_parameter_count():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples/configs/nemotron3_super_120b_a12b"
    config = NemotronHConfig.from_pretrained(root)
    assert (config.num_hidden_layers, config.mtp_hybrid_override_pattern) == (88, "*E")
    with torch.device("meta"):
        model = NemotronHForCausalLM(config)
    # the Hub checkpoint's bf16 tensors (its fp32 router biases aside): 123,611,012,096 values,
    # 2,942,324,736 of them under mtp.
    assert sum(p.numel() for p in model.parameters()) == 123_611_012_096
    assert sum(p.numel() for p in model.mtp.parameters()) == 2_942_324_736


def test_a_checkpoint_saved_without_its_mtp_layers_is_refused_naming_the_fix(tmp_path):
    """transformers (and most trainers) drop ``mtp.*`` when saving: loading such a folder names
    the missing layers and how to load the model without them."""
    from safetensors.torch import save_file

    model = NemotronHForCausalLM(mtp_config())
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    with safe_open(weights, "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("mtp.")}
    save_file(kept, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="set num_nextn_predict_layers to 0 in config.json"):
        NemotronHForCausalLM.from_pretrained(tmp_path)


def test_mtp_layers_compile_whole_under_checkpointing_and_match_eager():
    """``training.compile`` with activation checkpointing compiles the MTP layers as the blocks
    (parallelize's one compile step, each layer ``fullgraph=True``, ``aot_eager``): loss, the
    MTP depth's loss sum and every gradient as eager (fp32, 1e-5), on packed rows."""
    import copy

    from torch._dynamo.utils import counters

    from hybridtrain.config.sections import DistributedSection
    from hybridtrain.distributed.parallel_dims import ParallelDims
    from hybridtrain.models.nemotron_h.parallelize import parallelize_nemotron_h

    torch.manual_seed(0)
    eager = NemotronHForCausalLM(mtp_config("*E", hybrid_override_pattern="-"))
    eager.loss = LinearCrossEntropy(reduction="sum")
    compiled = copy.deepcopy(eager)
    training = trainer_settings({"compile": True, "activation_checkpointing": True}).training
    torch._dynamo.reset()
    counters.clear()
    parallelize_nemotron_h(compiled, ParallelDims(world_size=1), DistributedSection(), training,
                           device=torch.device("cpu"), autocast_dtype=None,
                           compile_options={"fullgraph": True, "backend": "aot_eager", "dynamic": False})
    assert all(type(m).__name__ == "CheckpointWrapper" for m in compiled.mtp.layers.values())
    ids = torch.randint(3, 256, (2, 12))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], 1)
    cu = torch.tensor([0, 7, 12, 17, 24], dtype=torch.int32)
    batch = {"input_ids": ids, "labels": labels, "cu_seqlens": cu}
    results = []
    for model in (eager, compiled):
        aux = setup_aux_losses(model, training)
        aux.begin_step(aux.counts(batch))
        loss = model(ids, labels=labels, cu_seqlens=cu)
        loss.backward()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
        results.append((loss.detach(), aux.step_sums("cpu"), grads))
        aux.end_step()
    assert not counters["graph_break"], dict(counters["graph_break"])
    # a graph per block: the MLP block and the MTP layers (they ran compiled)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    (loss, sums, grads), (want_loss, want_sums, want_grads) = results[1], results[0]
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums, want_sums, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys() and grads["mtp.layers.0.eh_proj.weight"].abs().sum() > 0
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-5, msg=n)
    torch._dynamo.reset()
