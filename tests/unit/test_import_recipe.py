"""`hybridtrain import-recipe`: NeMo Automodel recipes with the keys of its published Nemotron 3
Nano recipes (SQuAD under PP x EP; LoRA on chat data) become hybridtrain recipes that load, plan
and train the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.helpers.models import tiny_base

from hybridtrain.cli import main
from hybridtrain.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# A full SFT on SQuAD laid out as pipeline x expert parallel (the keys of Automodel's
# nemotron_nano_v3_pp_ep_squad recipe; values for the tiny model).
SQUAD_PP_EP = """
step_scheduler: {global_batch_size: 32, local_batch_size: 4, ckpt_every_steps: 100,
                 val_every_steps: 10, max_steps: 30}
dist_env:
  backend: nccl
  timeout_minutes: 5
  pytorch_alloc_conf: "expandable_segments:True"
  nemotronh_ep_use_deepep_dispatch: true
rng: {_target_: nemo_automodel.components.training.rng.StatefulRNG, seed: 5, ranked: true}
model:
  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained
  pretrained_model_name_or_path: nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16
  use_liger_kernel: true
autopipeline:
  _target_: nemo_automodel.components.distributed.pipelining.AutoPipeline
  pp_schedule: interleaved1f1b
  pp_microbatch_size: 2
  scale_grads_in_schedule: false
  module_fqns_per_model_part:
    - [backbone.embeddings, backbone.layers.0, backbone.layers.1]
    - [backbone.layers.2, backbone.layers.3]
    - [backbone.layers.4, backbone.layers.5]
    - [backbone.layers.6, backbone.norm_f, lm_head]
compile: {enabled: false, mode: default, dynamic: true}
checkpoint: {enabled: true, checkpoint_dir: checkpoints/, model_save_format: torch_save,
             save_consolidated: false}
distributed:
  _target_: nemo_automodel.components.distributed.fsdp2.FSDP2Manager
  dp_size: none
  dp_replicate_size: 1
  tp_size: 1
  cp_size: 1
  pp_size: 2
  ep_size: 2
  sequence_parallel: false
  activation_checkpointing: true
loss_fn: {_target_: nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy}
dataset:
  _target_: nemo_automodel.components.datasets.llm.squad.make_squad_dataset
  dataset_name: rajpurkar/squad
  split: train
  seq_length: 128
  padding: max_length
  truncation: true
packed_sequence: {packed_sequence_size: 0}
dataloader:
  _target_: torchdata.stateful_dataloader.StatefulDataLoader
  collate_fn: nemo_automodel.components.datasets.utils.default_collater
  shuffle: true
validation_dataset:
  _target_: nemo_automodel.components.datasets.llm.squad.make_squad_dataset
  dataset_name: rajpurkar/squad
  split: validation
  limit_dataset_samples: 8
  seq_length: 128
optimizer: {_target_: torch.optim.SGD, lr: 1.0e-3, momentum: 0.9}
lr_scheduler: {lr_decay_style: cosine, min_lr: 1.0e-5}
"""

# LoRA on chat data (the keys of Automodel's Nemotron Nano LoRA and chat recipes).
LORA_CHAT = """
recipe: TrainFinetuneRecipeForNextTokenPrediction
step_scheduler: {global_batch_size: 4, local_batch_size: 2, max_steps: 10, val_every_steps: 5,
                 ckpt_every_steps: 5}
dist_env: {backend: nccl, timeout_minutes: 1}
model:
  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained
  pretrained_model_name_or_path: BASE
  trust_remote_code: true
  backend: {_target_: nemo_automodel.components.models.common.BackendConfig, experts: gmm,
            dispatcher: torch}
peft:
  _target_: nemo_automodel.components._peft.lora.PeftConfig
  match_all_linear: true
  exclude_modules: ["*.out_proj"]
  dim: 4
  alpha: 16
  use_triton: true
distributed: {strategy: fsdp2, dp_size: 2, tp_size: 1, cp_size: 1, ep_size: 2}
dataset:
  _target_: nemo_automodel.components.datasets.llm.chat_dataset.ChatDataset
  path_or_dataset_id: TRAIN
  split: train
  seq_length: 256
validation_dataset:
  _target_: nemo_automodel.components.datasets.llm.chat_dataset.ChatDataset
  path_or_dataset_id: VALIDATION
  split: validation
  seq_length: 256
optimizer: {_target_: torch.optim.Adam, betas: [0.9, 0.999], eps: 1e-8, lr: 1.0e-3,
            weight_decay: 0.01}
wandb: {project: nano-lora, entity: my-team, name: first-try}
ci: {time: "00:20:00"}
"""


def _convert(tmp_path: Path, text: str, *args: str) -> tuple[Path, str]:
    src, out = tmp_path / "automodel.yaml", tmp_path / "hybridtrain.yaml"
    src.write_text(text)
    assert main(["import-recipe", str(src), "-o", str(out), *args]) == 0
    return out, out.read_text()


def _comment_above(text: str, line_start: str) -> str:
    """The comment right above the first line that starts with ``line_start`` (indent aside)."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.strip().startswith(line_start))
    above = []
    while i > 0 and lines[i - 1].strip().startswith("#"):
        i -= 1
        above.insert(0, lines[i].strip(" #"))
    return " ".join(above)


def _train(recipe: Path, tmp_path: Path, *overrides: str) -> list[dict]:
    out = tmp_path / "run"
    assert main(["finetune", "-c", str(recipe), f"--checkpoint.dir={out}",
                 "--training.max_steps=2", "--training.val_every_steps=2",
                 "--training.ckpt_every_steps=2", "--metrics.progress_bar=false",
                 "--metrics.plot=false", "--metrics.peak_tflops=1.0",
                 "--distributed.backend=auto", *overrides]) == 0
    return [json.loads(line) for line in open(out / "training.jsonl")]


def test_squad_pp_ep_recipe_loads_plans_and_trains(tmp_path, capsys):
    from hybridtrain.data import write_synthetic_squad

    base = tmp_path / "base"
    tiny_base(base)
    recipe, text = _convert(tmp_path, SQUAD_PP_EP, "--model-dir", str(base))
    err = capsys.readouterr().err

    cfg = load_config(recipe)
    t, d = cfg.training, cfg.distributed
    assert (t.global_batch_size, t.micro_batch_size, t.max_steps, t.seed) == (32, 4, 30, 5)
    assert (d.pp, d.ep, d.tp, d.dp_shard, d.pp_schedule) == (2, 2, 1, -1, "interleaved1f1b")
    assert (d.pp_split_points, d.pp_stages_per_rank, d.timeout_seconds) == ([2, 4, 6], 2, 300)
    assert t.activation_checkpointing is True and cfg.packing.enabled is False
    assert cfg.model["local_dir"] == str(base) and cfg.tokenizer["path"] == str(base)
    assert cfg.optimizer["_target_"] == "torch.optim.SGD" and cfg.optimizer["momentum"] == 0.9
    # Automodel's implicit schedule defaults, written out and said so
    assert (cfg.lr_scheduler.lr_warmup_steps, cfg.lr_scheduler.min_lr) == (3, 1e-5)
    assert "Automodel's default" in _comment_above(text, "lr_warmup_steps")
    assert "timeout_minutes 5, in seconds" in _comment_above(text, "timeout_seconds")
    assert "never the Hub" in _comment_above(text, "path: data/squad/train")
    assert cfg.dist_env["pytorch_alloc_conf"] == "expandable_segments:True"
    for key in ("dist_env.nemotronh_ep_use_deepep_dispatch", "loss_fn", "compile.dynamic"):
        assert f"#   {key}:" in text and f"left out {key}:" in err

    # the plan of its layout on 4 ranks (pp 2 x dp_shard 2, ep 2 borrowed from dp_shard)
    assert main(["plan", "-c", str(recipe), "--nproc-per-node", "4", "--device-type", "cpu"]) == 0
    assert "pipeline stages" in capsys.readouterr().out

    # 2 steps in one process, on synthetic SQuAD files in place of the Hub's
    files = [write_synthetic_squad(tmp_path / f"{s}.json", n, seed=s == "dev")
             for s, n in (("train", 64), ("dev", 8))]
    recs = _train(recipe, tmp_path, f"--dataset.path={files[0]}",
                  f"--validation_dataset.path={files[1]}", "--distributed.pp=1",
                  "--distributed.ep=1", "--distributed.pp_split_points=null",
                  "--distributed.pp_stages_per_rank=null", "--training.global_batch_size=4",
                  "--training.micro_batch_size=2")
    assert [r["step"] for r in recs] == [1, 2] and all(r["loss"] > 0 for r in recs)


def test_lora_chat_recipe_loads_plans_and_trains(tmp_path, capsys):
    base = tmp_path / "base"
    tiny_base(base)
    text = (LORA_CHAT.replace("BASE", str(base))
            .replace("TRAIN", str(EXAMPLES / "data" / "chat_tiny_train.jsonl"))
            .replace("VALIDATION", str(EXAMPLES / "data" / "chat_tiny_validation.jsonl")))
    recipe, out = _convert(tmp_path, text)  # the model folder from pretrained_model_name_or_path
    err = capsys.readouterr().err

    cfg = load_config(recipe)
    p = cfg.peft
    assert (p.method, p.dim, p.alpha, p.match_all_linear, p.exclude_modules) == (
        "lora", 4, 16, True, ["*.out_proj"])
    assert (cfg.distributed.ep, cfg.distributed.dp_shard, cfg.training.grouped_mm) == (2, 2, True)
    assert "dp_size 2" in _comment_above(out, "dp_shard")
    assert (cfg.optimizer.name, cfg.optimizer.weight_decay) == ("adamw", 0.01)
    assert "not the same update" in _comment_above(out, "weight_decay")
    assert cfg.lr_scheduler.lr_decay_style == "constant"  # no lr_scheduler: Automodel's constant
    assert (cfg.metrics.wandb, cfg.metrics.project, cfg.metrics.run_name) == (
        True, "nano-lora", "first-try")
    assert "WANDB_ENTITY=my-team" in err and "#   wandb.entity:" in out
    assert "left out peft.use_triton: nothing to do" in err
    assert "split" not in cfg.dataset  # a file holds one split

    assert main(["plan", "-c", str(recipe), "--nproc-per-node", "2", "--device-type", "cpu"]) == 0
    recs = _train(recipe, tmp_path, "--distributed.ep=1", "--distributed.dp_shard=-1",
                  "--metrics.wandb=false", "--+dataset.limit=16", "--+validation_dataset.limit=4")
    assert [r["step"] for r in recs] == [1, 2]


def test_a_hub_model_not_on_disk_is_refused_with_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    src = tmp_path / "automodel.yaml"
    src.write_text("model: {pretrained_model_name_or_path: nvidia/Some-Model}\n")
    assert main(["import-recipe", str(src)]) == 2
    err = capsys.readouterr().err
    assert "hf download nvidia/Some-Model --local-dir DIR" in err and "--model-dir" in err


@pytest.mark.parametrize("text, message", [("- a\n- b\n", "holds no mapping"),
                                           ("a: [\n", "is not YAML")])
def test_a_file_that_is_no_recipe_is_refused(tmp_path, capsys, text, message):
    src = tmp_path / "automodel.yaml"
    src.write_text(text)
    assert main(["import-recipe", str(src)]) == 2
    assert message in capsys.readouterr().err
