"""`hybridtrain benchmark`: the recipe runs on CPU and reports tokens/s, TFLOPs, MFU,
memory and the cost growth over sequence lengths.

Speed itself is not asserted here (timed unit tests are flaky by nature); benchmarks/ prints the
measured ratios."""

import json
import os

import pytest

from hybridtrain.recipes.benchmark import _collate_synthetic, run, synthetic_rows


def _cfg(tmp_path, **bench):
    return {
        "model": {
            "_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM",
            "config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config", "kind": "mixed"},
        },
        "training": {"global_batch_size": 2, "micro_batch_size": 2, "seed": 0, "device": "cpu"},  # dtype auto: fp32 for this narrow model
        "checkpoint": {"dir": str(tmp_path / "run")},
        "benchmark": {"warmup_steps": 1, "steps": 1, "seq_len": 32, "seq_lengths": [16, 64], **bench},
    }


def test_benchmark_reports_throughput_flops_mfu_memory_and_growth(tmp_path, capsys):
    res = run(_cfg(tmp_path, profile=str(tmp_path / "prof"), measure_peak=True, doc_length=12))
    out = capsys.readouterr().out
    assert "tokens/s" in out and "MFU" in out and "cost growth" in out
    # which implementation each part ran: one line, and the same in the JSON
    line = next(x for x in out.splitlines() if x.startswith("kernel paths: "))
    assert "ssd=PyTorch (auto: kernels for CUDA tensors)" in line and "loss=PyTorch chunked loss" in line, line
    on_disk = json.loads(open(tmp_path / "run" / "benchmark.json").read())
    assert [r["name"] for r in on_disk["runs"]] == ["float32_main", "float32_L16", "float32_L64"]
    for r in on_disk["runs"]:
        for key in ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu"):
            assert r[key] is not None and r[key] > 0, (r["name"], key)
        # the CPU figure is resident-size growth; on this tiny model a later run can reuse
        # memory an earlier one already grew into, so only the first run must show growth
        assert r["peak_memory_gb"] is not None and r["peak_memory_gb"] >= 0, r["name"]
        assert r["tokens_per_step"] == 64  # global_batch_size x seq_len tokens, at every length
    assert on_disk["runs"][0]["peak_memory_gb"] > 0
    assert on_disk["matmul_peak_tflops_measured"]["torch.float32"] > 0
    main = on_disk["runs"][0]
    assert main["peak_tflops"] == on_disk["matmul_peak_tflops_measured"]["torch.float32"]
    assert main["mfu"] == pytest.approx(main["tflops_per_device"] / main["peak_tflops"])
    assert os.path.isfile(main["profile"]) and json.load(open(main["profile"]))["traceEvents"]
    # the top operators by time are printed beside the MFU line, the matmuls among them
    assert "top 30 operators/kernels by self CPU time" in out and "aten::mm" in out
    assert out.index("MFU") < out.index("top 30 operators")
    growth = on_disk["cost_growth"]["torch.float32"]
    assert [g["seq_len"] for g in growth] == [16, 64]
    assert res["output"] == str(tmp_path / "run" / "benchmark.json")
    assert set(on_disk["kernel_paths"]) == {"ssd", "state_update", "conv", "loss", "attention", "experts"}


def test_benchmark_compares_dtypes(tmp_path):
    cfg = _cfg(tmp_path, dtypes=["float32", "bfloat16"], seq_lengths=[])
    # a given peak: no timed 2048^2 matmul probe per dtype (minutes of emulated bf16 on CPUs
    # without avx512_bf16); the peak probe has its own test above
    cfg["metrics"] = {"peak_tflops": 1.0}
    res = run(cfg)
    assert [r["name"] for r in res["runs"]] == ["float32_main", "bfloat16_main"]
    assert [r["dtype"] for r in res["runs"]] == ["torch.float32", "torch.bfloat16"]
    assert all(r["tokens_per_s"] > 0 for r in res["runs"])
    (ratio,) = res["dtype_ratios"]
    assert ratio["measurement"] == "bfloat16_main" and ratio["vs_dtype"] == "torch.float32"
    assert ratio["tokens_per_s_ratio"] == pytest.approx(res["runs"][1]["tokens_per_s"] / res["runs"][0]["tokens_per_s"])


def test_benchmark_on_the_recipe_data(tmp_path):
    cfg = _cfg(tmp_path, data="recipe", seq_lengths=[])
    cfg["tokenizer"] = {
        "_target_": "hybridtrain.data.build_bpe_tokenizer",
        "texts": {"_target_": "hybridtrain.data.synthetic_texts", "num_questions": 50, "seed": 0},
        "out_dir": str(tmp_path / "tok"), "vocab_size": 512,
    }
    cfg["model"]["config"]["vocab_size"] = 512
    cfg["dataset"] = {
        "_target_": "hybridtrain.data.build_squad_dataset",
        "path": {"_target_": "hybridtrain.data.write_synthetic_squad", "path": str(tmp_path / "d.json"),
                 "num_questions": 50, "seed": 0},
        "seq_length": 128, "cache_dir": str(tmp_path / "cache"),
    }
    cfg["packing"] = {"enabled": True, "pack_size": 256}
    res = run(cfg)
    main = res["runs"][0]
    assert main["data"] == "recipe" and main["tokens_per_s"] > 0
    # packed rows of real examples: fewer tokens than the 2 x 256 slots, never more
    assert 0 < main["tokens_per_step"] <= 2 * 256


def test_synthetic_rows_are_packed_documents():
    rows = synthetic_rows(2, 10, 50, doc_length=4, seed=0)
    r = rows[0]
    assert r["cu_seqlens"].tolist() == [0, 4, 8, 10]
    assert r["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    ids, labels = r["input_ids"], r["labels"]
    for a, b in [(0, 4), (4, 8), (8, 10)]:  # labels shifted inside each document, none across
        assert labels[a:b - 1].tolist() == ids[a + 1:b].tolist() and labels[b - 1] == -100
    batch = _collate_synthetic(rows, packed=True)
    assert batch["cu_seqlens"].tolist() == [0, 4, 8, 10, 14, 18, 20]
    assert int(batch["num_tokens"]) == 20 and int(batch["num_label_tokens"]) == 14
    assert "cu_seqlens" not in _collate_synthetic(synthetic_rows(2, 10, 50), packed=False)


@pytest.mark.parametrize("bad, match", [
    ({"data": "files"}, "benchmark.data"),
    ({"steps": 0}, "benchmark.steps"),
    ({"seq_lengths": [0]}, "seq_lengths"),
    ({"stepz": 3}, "unknown key"),
])
def test_benchmark_options_are_checked(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        run(_cfg(tmp_path, **bad))


def test_tokenizer_larger_than_the_model_vocab_is_an_error(tmp_path):
    cfg = _cfg(tmp_path, data="recipe")
    cfg["tokenizer"] = {
        "_target_": "hybridtrain.data.build_bpe_tokenizer",
        "texts": {"_target_": "hybridtrain.data.synthetic_texts", "num_questions": 20, "seed": 0},
        "out_dir": str(tmp_path / "tok"), "vocab_size": 300,
    }
    with pytest.raises(ValueError, match="vocab_size"):
        run(cfg)


def test_benchmark_keys_are_recipe_keys(tmp_path):
    """`benchmark` is a recipe section: overrides need no `+` (the old `+` form still works),
    absent keys take their defaults, a typo is refused with a suggestion."""
    from hybridtrain.config import build_config

    data = _cfg(tmp_path)
    del data["benchmark"]
    assert build_config(data).benchmark is None  # optional: absent unless given
    cfg = build_config(data, ["--benchmark.steps=3", "--+benchmark.warmup_steps=0"])
    assert cfg.benchmark.steps == 3 and cfg.benchmark.warmup_steps == 0
    assert cfg.benchmark.seq_lengths == [512, 2048, 8192] and cfg.benchmark.data == "synthetic"
    with pytest.raises(ValueError, match=r"benchmark.stepz.*did you mean 'steps'"):
        build_config(data, ["--benchmark.stepz=3"])


@pytest.mark.parametrize("mtp", [True, False])
def test_decoding_table_plain_and_speculative_side_by_side(tmp_path, capsys, mtp):
    cfg = _cfg(tmp_path, decode_tokens=6, draft_tokens=2, seq_lengths=[])
    if mtp:
        cfg["model"]["config"].update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    row = run(cfg)["decode"]
    assert row["plain_tokens_per_s"] > 0 and row["new_tokens"] == 6
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("decode"))
    assert "plain" in line and "speculative" in line and "on cpu, " in line
    if mtp:
        assert row["speculative_tokens_per_s"] > 0 and 0 <= row["acceptance_rate"] <= 1
    else:
        assert row["speculative_tokens_per_s"] is None and "no multi-token prediction" in row["speculative"]
