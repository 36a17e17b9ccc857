"""Truncated or corrupt files through the CLI: model weights, a PEFT adapter, and each file of a
checkpoint a run resumes from. The error names the file (and, for a checkpoint, the previous one
to resume from instead); nothing is written into the run folder."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml
from tests.helpers.recipes import tiny_recipe

from hybridtrain.cli import main


def truncate(path, keep: float = 0.5) -> None:
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])


def write_recipe(tmp_path, model=None) -> str:
    recipe = tiny_recipe()
    if model is not None:
        recipe["model"] = model
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A saved tiny model (config.json + model.safetensors) and a LoRA adapter of it."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config
    from hybridtrain.peft import apply_lora, save_peft_adapter

    root = tmp_path_factory.mktemp("hf")
    model = NemotronHForCausalLM(tiny_config(kind="mixed"))
    model.save_pretrained(root / "base")
    apply_lora(model, dim=2, alpha=4, target_modules=["q_proj"])
    save_peft_adapter(model, root / "adapter", str(root / "base"))
    return root


def test_truncated_model_weights_name_the_file(tmp_path, tiny_hf, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_hf / "base", base)
    truncate(base / "model.safetensors")
    model = {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM.from_pretrained",
             "local_dir": str(base)}
    out = tmp_path / "run"
    assert main(["finetune", "-c", write_recipe(tmp_path, model=model),
                 f"--checkpoint.dir={out}", "--training.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert (f"{base / 'model.safetensors'}: not a readable safetensors file, truncated or "
            "corrupt") in err and "Traceback" not in err
    assert not out.exists()


def test_truncated_adapter_names_the_file(tmp_path, tiny_hf, capsys):
    adapter = tmp_path / "adapter"
    shutil.copytree(tiny_hf / "adapter", adapter)
    truncate(adapter / "adapter_model.safetensors", 0.9)
    assert main(["merge", "--base", str(tiny_hf / "base"), "--adapter", str(adapter),
                 "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert (f"{adapter / 'adapter_model.safetensors'}: not a readable safetensors file, "
            "truncated or corrupt") in err
    assert not (tmp_path / "merged").exists()


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run folder with step_1 and step_2 (latest), and the recipe and arguments that made it."""
    tmp = tmp_path_factory.mktemp("ckpt")
    args = ["finetune", "-c", write_recipe(tmp), "--metrics.progress_bar=false",
            "--training.global_batch_size=2", "--training.ckpt_every_steps=1"]
    assert main(args + [f"--checkpoint.dir={tmp / 'run'}", "--training.max_steps=2"]) == 0
    return tmp / "run", args


@pytest.mark.parametrize("victim", ["step_2/dcp/__0_0.distcp", "step_2/dcp/.metadata",
                                    "step_2/trainer_state.json", "step_2/rng/rank_0.json",
                                    "step_1/trainer_state.json"])
def test_resume_from_a_truncated_checkpoint_names_it_and_the_previous_one(
        tmp_path, two_checkpoints, capsys, victim):
    src, args = two_checkpoints
    run = tmp_path / "run"
    shutil.copytree(src, run, symlinks=True)
    step = victim.split("/")[0]
    if step == "step_1":  # the oldest checkpoint is broken: there is none before it
        (run / "latest").write_text("step_1\n")
    truncate(run / victim)
    before = {p: os.path.getmtime(p) for p in run.rglob("*")}
    code = main(args + [f"--checkpoint.dir={run}", "--training.max_steps=3",
                        "--checkpoint.resume=auto"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert f"hybridtrain: error: checkpoint {run / step} is truncated or corrupt: " in err
    if victim.endswith(".json"):
        assert f"{run / victim}: line " in err  # the file and where it breaks
    elif victim.endswith(".metadata"):
        assert f"{run / victim} cannot be read" in err
    else:
        assert f"{run / step / 'dcp'} cannot be read" in err
    if step == "step_2":
        assert f"Resume from the previous checkpoint instead: --checkpoint.resume={run}/step_1" in err
    else:
        assert "There is no earlier checkpoint beside it to resume from" in err
    assert {p: os.path.getmtime(p) for p in run.rglob("*")} == before  # nothing written
    if step == "step_2":  # the suggestion works
        assert main(args + [f"--checkpoint.dir={run}", "--training.max_steps=2",
                            f"--checkpoint.resume={run}/step_1"]) == 0


def test_resume_with_a_deleted_metadata_names_it_without_tracebacks(tmp_path, two_checkpoints,
                                                                    capsys):
    src, args = two_checkpoints
    run = tmp_path / "run"
    shutil.copytree(src, run, symlinks=True)
    os.remove(run / "step_2/dcp/.metadata")
    code = main(args + [f"--checkpoint.dir={run}", "--training.max_steps=3",
                        "--checkpoint.resume=auto"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{run / 'step_2/dcp/.metadata'} is missing" in err, err[-2000:]
    assert f"--checkpoint.resume={run}/step_1" in err
    assert "Traceback" not in err, err[-3000:]


class _Payload:
    """Unpickles by calling ``os.system`` (what a replaced ``.metadata`` could do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _non_tensor_index(dcp_dir):
    """A well-formed DCP index whose model entry is declared as bytes (DCP would unpickle the
    shard's bytes for it with weights_only=False)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from hybridtrain.training.dcp_safe import read_metadata

    md = read_metadata(dcp_dir)
    key = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[key] = BytesStorageMetadata()
    return md, key


@pytest.fixture
def poisoned_run(tmp_path, two_checkpoints):
    """A copy of the two-checkpoint run whose every ``dcp/.metadata`` runs a shell command when
    unpickled, and without exports (so every reader goes to the DCP checkpoint)."""
    import pickle

    src, args = two_checkpoints
    run = tmp_path / "run"
    shutil.copytree(src, run, symlinks=True)
    marker = tmp_path / "pwned"
    for step in ("step_1", "step_2"):
        for export in ("hf", "adapter", "merged_hf"):
            shutil.rmtree(run / step / export, ignore_errors=True)
        (run / step / "tokenizer").mkdir(exist_ok=True)
        (run / step / "dcp/.metadata").write_bytes(pickle.dumps(_Payload(marker)))
    return run, marker, args


def _refusal_named(err: str, run) -> bool:
    return (f"{run}/step_2/dcp/.metadata: refused to load 'posix.system'" in err
            or f"{run}/step_2/dcp/.metadata: refused to load 'os.system'" in err)


def test_a_code_payload_in_metadata_is_refused_on_resume(poisoned_run, capsys):
    run, marker, args = poisoned_run
    code = main(args + [f"--checkpoint.dir={run}", "--training.max_steps=3",
                        "--checkpoint.resume=auto"])
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists()
    assert _refusal_named(err, run), err[-2000:]
    assert "Traceback" not in err


def test_a_code_payload_in_metadata_is_refused_by_convert(poisoned_run, tmp_path, capsys):
    run, marker, _ = poisoned_run
    assert main(["convert", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert not marker.exists() and _refusal_named(err, run), err[-2000:]


def test_a_code_payload_in_metadata_is_refused_by_generate(poisoned_run, capsys):
    run, marker, _ = poisoned_run
    assert main(["generate", "--model", str(run / "step_2"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert not marker.exists() and _refusal_named(err, run), err[-2000:]


def test_a_non_tensor_entry_in_metadata_is_refused(tmp_path, two_checkpoints):
    import pickle

    import torch

    from hybridtrain.training.checkpoint_reader import load_checkpoint_model
    from hybridtrain.training.dcp_safe import UnsafeCheckpointError, read_metadata

    src, _ = two_checkpoints
    step = tmp_path / "step_2"
    shutil.copytree(src / "step_2", step, symlinks=True)
    md, key = _non_tensor_index(step / "dcp")
    (step / "dcp/.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match=f"entry '{key}' is a BytesStorageMetadata"):
        read_metadata(step / "dcp")
    with pytest.raises(UnsafeCheckpointError, match=str(step / "dcp/.metadata")):
        load_checkpoint_model(str(step))
    # a tensor stored outside the folder is refused too
    md = read_metadata(src / "step_2/dcp")
    for record in md.storage_data.values():
        record.relative_path = "../../elsewhere.distcp"
    (step / "dcp/.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="not a file inside"):
        read_metadata(step / "dcp")
    assert torch.Size  # the real index still loads
    assert read_metadata(src / "step_2/dcp").state_dict_metadata


@pytest.mark.parametrize("model_class", ["hybridtrain.models.nope.Model", "os.system",
                                         "hybridtrain.cli.main", 5, None])
def test_a_bad_model_class_in_trainer_state_is_named(tmp_path, two_checkpoints, capsys,
                                                     model_class):
    import json

    src, _ = two_checkpoints
    step = tmp_path / "step_2"
    shutil.copytree(src / "step_2", step, symlinks=True)
    state_path = step / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["model_class"] = model_class
    state_path.write_text(json.dumps(state))
    assert main(["convert", str(step), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{state_path}: 'model_class'" in err and "restore 'model_class'" in err, err[-2000:]
    assert "Traceback" not in err


def test_a_corrupt_data_cache_is_named_and_rebuilt(tmp_path, caplog):
    import json
    import logging

    from hybridtrain.data import build_bpe_tokenizer, build_squad_dataset, write_synthetic_squad

    data = write_synthetic_squad(tmp_path / "train.json", 12, seed=0)
    tok = build_bpe_tokenizer([data.read_text()], tmp_path / "tok", vocab_size=270)
    cache = tmp_path / "cache"
    first = build_squad_dataset(str(data), tok, seq_length=128, cache_dir=str(cache))
    want = [first.get_unpadded(i) for i in range(len(first))]
    entry = first.cache_path
    for damage in ("arrow", "record", "rows"):
        if damage == "arrow":
            truncate(next(entry.glob("*.arrow")), 0.5)
        elif damage == "record":
            (entry / "hybridtrain_meta.json").write_text("{not json")
        else:
            meta = json.loads((entry / "hybridtrain_meta.json").read_text())
            meta["stats"]["kept"] += 5
            (entry / "hybridtrain_meta.json").write_text(json.dumps(meta))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hybridtrain.data"):
            again = build_squad_dataset(str(data), tok, seq_length=128, cache_dir=str(cache))
        assert f"the tokenized-data cache {entry} cannot be read" in caplog.text, damage
        assert "rebuilding it" in caplog.text
        assert [again.get_unpadded(i) for i in range(len(again))] == want, damage


def test_a_truncated_image_names_the_image_and_the_record(tmp_path):
    from hybridtrain.data import (build_bpe_tokenizer, build_vision_chat_dataset, shapes_texts,
                                  write_synthetic_shapes)
    from hybridtrain.data.io import DataError

    tok = build_bpe_tokenizer(shapes_texts()[:50], tmp_path / "tok", vocab_size=270,
                              extra_special_tokens=["<image>"])
    write_synthetic_shapes(tmp_path / "data", 4, seed=0, text_only=0.0)
    ds = build_vision_chat_dataset(str(tmp_path / "data" / "data.jsonl"), tok, patch_size=4,
                                   min_patches=16, max_patches=64)
    image = ds.image_list(0)[0][0]
    truncate(image, 0.5)
    with pytest.raises(DataError) as e:
        ds[0]
    assert str(e.value).startswith(f"{ds.record_id(0)}: image {image} is truncated or corrupt")
    assert "replace the file" in str(e.value)
