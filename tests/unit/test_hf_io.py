"""Hub checkpoint I/O: round trips with transformers, sharding, dtype, atomic saves, and errors
that name every offending tensor."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch
from tests.helpers.hf import hf_from_dir, hf_logits, reference_clamp, transformers
from tests.helpers.models import perturbed_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybridtrain.models.nemotron_h import CheckpointMismatchError, NemotronHForCausalLM, tiny_config
from hybridtrain.models.nemotron_h.hf_io import INDEX_FILE, parse_size


def _hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    d = cfg.to_hf_dict()
    hf_cfg = transformers.NemotronHConfig(**{**d, **reference_clamp(d)})
    hf_cfg._attn_implementation = "eager"  # as hf_from_dir loads it
    hf = transformers.NemotronHForCausalLM(hf_cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for b in hf.buffers():
            b.add_(torch.randn_like(b) * 0.05)
    return hf.eval()


def _hf_save(hf, path, **kw):
    with contextlib.redirect_stderr(io.StringIO()):
        hf.save_pretrained(path, **kw)


def _tensors(path):
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, fn)))
    return out


@pytest.mark.parametrize("kind", ["moe", "mixed"])
def test_round_trip_hf_ours_hf(kind, tmp_path):
    """HF save_pretrained -> our load -> our save -> HF load: identical tensors and logits."""
    cfg = tiny_config(kind)
    hf = _hf_model(cfg, seed=11)
    _hf_save(hf, tmp_path / "hf")
    ours = NemotronHForCausalLM.from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    hf2 = hf_from_dir(tmp_path / "ours")

    a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "ours")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    sd1, sd2 = hf.state_dict(), hf2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)

    ids = torch.randint(0, cfg.vocab_size, (2, 19))
    l1, l2 = hf_logits(hf, ids), hf_logits(hf2, ids)
    assert torch.equal(l1, l2)
    with torch.no_grad():
        diff = (ours(ids) - l1).abs().max().item()
    print(f"\n[round trip] {kind}: tensors identical, HF logits identical, ours vs HF max diff {diff:.2e}")
    assert diff <= 1e-4


def test_sharded_save_and_load(tmp_path):
    cfg = tiny_config("moe")
    ours = perturbed_model(cfg, seed=12)
    ours.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    files = sorted(f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(tmp_path / "ckpt" / INDEX_FILE) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(files)
    for fn in files:  # every shard within the limit unless it holds a single larger tensor
        with safe_open(str(tmp_path / "ckpt" / fn), "pt") as f:
            keys = list(f.keys())
        assert len(keys) == 1 or os.path.getsize(tmp_path / "ckpt" / fn) <= 100_000 + 10_000
    assert "backbone.layers.1.mixer.experts.7.down_proj.weight" in index["weight_map"]

    back = NemotronHForCausalLM.from_pretrained(tmp_path / "ckpt")
    sd1, sd2 = ours.state_dict(), back.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    hf = hf_from_dir(tmp_path / "ckpt")  # transformers reads our sharded layout too
    ids = torch.randint(0, cfg.vocab_size, (1, 13))
    with torch.no_grad():
        assert (ours(ids) - hf_logits(hf, ids)).abs().max() <= 1e-4

    # transformers' own sharded save loads in ours
    _hf_save(hf, tmp_path / "hf_sharded", max_shard_size="100KB")
    assert os.path.isfile(tmp_path / "hf_sharded" / INDEX_FILE)
    again = NemotronHForCausalLM.from_pretrained(tmp_path / "hf_sharded")
    assert all(torch.equal(sd1[k], again.state_dict()[k]) for k in sd1)


def test_load_dtype_and_device(tmp_path):
    cfg = tiny_config("moe")
    ours = perturbed_model(cfg, seed=13)
    ours.save_pretrained(tmp_path / "ckpt")
    bf = NemotronHForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16, device="cpu")
    assert bf.lm_head.weight.dtype == torch.bfloat16
    assert bf.backbone.layers["1"].mixer.gate.e_score_correction_bias.dtype == torch.float32
    bf.save_pretrained(tmp_path / "bf16")
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    as_stored = NemotronHForCausalLM.from_pretrained(tmp_path / "bf16")  # dtype=None keeps bf16
    assert as_stored.lm_head.weight.dtype == torch.bfloat16
    up = NemotronHForCausalLM.from_pretrained(tmp_path / "bf16", dtype="float32")
    assert up.lm_head.weight.dtype == torch.float32
    assert not any(p.is_meta for p in up.parameters())


def test_save_is_atomic_and_replaces_old_weights(tmp_path):
    cfg = tiny_config("dense")
    target = tmp_path / "out"
    perturbed_model(cfg, seed=1).save_pretrained(target, max_shard_size="50KB")
    assert os.path.isfile(target / INDEX_FILE)
    (target / "tokenizer.json").write_text("{}")
    m2 = perturbed_model(cfg, seed=2)
    m2.save_pretrained(target)  # now a single file: old shards and index must go
    names = set(os.listdir(target))
    assert names == {"model.safetensors", "config.json", "tokenizer.json"}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.tmp")]
    back = NemotronHForCausalLM.from_pretrained(target)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in m2.state_dict().items())


def _corrupt(tmp_path, fn):
    cfg = tiny_config("moe")
    perturbed_model(cfg).save_pretrained(tmp_path / "ckpt")
    path = str(tmp_path / "ckpt" / "model.safetensors")
    t = load_file(path)
    fn(t)
    save_file(t, path, metadata={"format": "pt"})
    return tmp_path / "ckpt"


def test_missing_tensor_is_named(tmp_path):
    d = _corrupt(tmp_path, lambda t: (t.pop("backbone.layers.3.mixer.q_proj.weight"),
                                      t.pop("backbone.layers.1.mixer.experts.5.up_proj.weight")))
    with pytest.raises(CheckpointMismatchError) as e:
        NemotronHForCausalLM.from_pretrained(d)
    msg = str(e.value)
    assert "missing tensors (2)" in msg
    assert "backbone.layers.3.mixer.q_proj.weight" in msg and "backbone.layers.1.mixer.experts.5.up_proj.weight" in msg


def test_wrong_shape_and_unexpected_tensors_are_named(tmp_path):
    def edit(t):
        t["backbone.layers.0.mixer.in_proj.weight"] = t["backbone.layers.0.mixer.in_proj.weight"][:-1].contiguous()
        t["backbone.layers.0.mixer.bogus.weight"] = torch.zeros(2)
        t["mtp.layers.0.norm.weight"] = torch.zeros(2)  # multi-token-prediction heads are ignored

    d = _corrupt(tmp_path, edit)
    with pytest.raises(ValueError) as e:
        NemotronHForCausalLM.from_pretrained(d)
    msg = str(e.value)
    assert "wrong shape: backbone.layers.0.mixer.in_proj.weight" in msg
    assert "checkpoint has [327, 64], model expects [328, 64]" in msg
    assert "unexpected tensors (1): backbone.layers.0.mixer.bogus.weight" in msg
    assert "mtp." not in msg


def test_unknown_layer_character_in_config_json_is_named(tmp_path):
    cfg = tiny_config("dense")
    perturbed_model(cfg).save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    d = json.loads(path.read_text())
    d.pop("layers_block_type")
    d["hybrid_override_pattern"] = "M-X*-M"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"hybrid_override_pattern.*'X' at position 2"):
        NemotronHForCausalLM.from_pretrained(tmp_path / "ckpt")


def test_legacy_config_json_loads(tmp_path):
    """A config.json in the older NVIDIA spelling (pattern string, mamba_* aliases,
    attention_head_dim, Infinity literal) loads in ours; our rewritten config loads in transformers."""
    cfg = tiny_config("mixed")
    ours = perturbed_model(cfg, seed=3)
    ours.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    d = json.loads(path.read_text())
    for k in ("layers_block_type", "n_groups", "conv_kernel", "head_dim", "chunk_size"):
        d.pop(k)
    d.update(mamba_n_groups=cfg.n_groups, mamba_d_conv=cfg.conv_kernel, attention_head_dim=cfg.head_dim,
             mamba_chunk_size=cfg.chunk_size, hybrid_override_pattern=cfg.hybrid_override_pattern)
    path.write_text(json.dumps(d))
    back = NemotronHForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert back.config.to_hf_dict() == cfg.to_hf_dict()
    back.save_pretrained(tmp_path / "rewritten")
    hf = hf_from_dir(tmp_path / "rewritten")
    ids = torch.randint(0, cfg.vocab_size, (1, 17))
    with torch.no_grad():
        assert (ours(ids) - hf_logits(hf, ids)).abs().max() <= 1e-4


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("100KB") == 100_000
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


def test_not_a_checkpoint_dir(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        NemotronHForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        NemotronHForCausalLM.from_pretrained(tmp_path / "nope")
