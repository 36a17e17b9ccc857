"""``hybridtrain plan``: the meta-device model (no weights read), per-rank parameter / gradient /
optimizer figures against a real one-process run, the 30B recipes' layouts, LoRA, the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hybridtrain import cli
from hybridtrain.training.memory_plan import meta_model, plan_memory
from hybridtrain.recipes.plan import parse_memory
from tests.helpers import parity as pu
from tests.helpers.memory import assert_close_10pct, held_at_optimizer_step, planned_bytes

ROOT = Path(__file__).resolve().parents[2]
NANO = ROOT / "examples" / "configs" / "nemotron3_nano_30b_a3b"
OMNI = ROOT / "examples" / "configs" / "nemotron3_nano_omni_30b_a3b"
GiB = 2 ** 30


@pytest.fixture
def nano_dir(monkeypatch):
    monkeypatch.setenv("NEMOTRON3_NANO_DIR", str(NANO))
    monkeypatch.setenv("NEMOTRON3_NANO_OMNI_DIR", str(OMNI))


def test_nano_config_builds_on_meta_with_the_model_cards_size(nano_dir):
    from hybridtrain.config import load_config

    cfg = load_config(ROOT / "examples" / "nemotron3_nano_squad.yaml")
    _, model = meta_model(cfg.model)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok) == (
        2688, 52, 128, 6)
    types = c.layers_block_type
    assert (types.count("linear_attention"), types.count("moe"),
            types.count("full_attention")) == (23, 23, 6)
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 31.6e9) < 0.05e9, n  # the model card: 31.6B total parameters
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # model.dtype: float32


@pytest.mark.parametrize("packed", [False])
def test_one_process_figures_match_a_real_step(packed):
    """Parameters, gradients and AdamW state at a real optimizer step (the recipe's builder and
    trainer) equal the plan's (the 10 % bound holds exactly here)."""
    recipe = pu.recipe({}, packed)
    b, trainer = pu.build({}, 1, packed)
    got = held_at_optimizer_step(b, trainer)
    plan = plan_memory(recipe, 1, device_type="cpu")
    assert_close_10pct(got, planned_bytes(plan, 0), "one process")
    assert plan.ranks[0].params == got["params"]


def _bf16_gemms_run_on_onednn(capfd) -> bool:
    """Whether this process's bf16 GEMMs are oneDNN's, as oneDNN itself reports them (its
    verbose mode prints each primitive it runs)."""
    import ctypes

    x = torch.randn(64, 64, dtype=torch.bfloat16)
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        torch.nn.functional.linear(x, x)
    ctypes.CDLL(None).fflush(None)
    return "onednn_verbose,v1,primitive,exec,cpu,matmul" in capfd.readouterr().out


def test_cpu_low_precision_plans_the_gemm_kernel_cache(monkeypatch, capfd):
    """A CPU bf16 run whose GEMMs are oneDNN's (a CPU with AVX-512) holds oneDNN's per-shape
    GEMM kernels up to the cache bound in effect (config/dist_env.py: 128 unless the environment
    says otherwise, 1 MiB each); where torch runs them in its own loops (no AVX-512:
    ``make test-cpu-kinds`` runs this under both), fp32 CPU GEMMs (MKL) and GPU runs hold none."""
    from hybridtrain.config.dist_env import GEMM_KERNEL_CACHE_VARS

    for name in GEMM_KERNEL_CACHE_VARS:
        monkeypatch.delenv(name, raising=False)
    recipe = pu.recipe({}, False, training={"dtype": "bfloat16"})
    assert "cpu_gemm_kernels" not in plan_memory(pu.recipe({}, False), 1, device_type="cpu").ranks[0].buffers
    assert "cpu_gemm_kernels" not in plan_memory(recipe, 1, device_type="cuda").ranks[0].buffers
    buffers = plan_memory(recipe, 1, device_type="cpu").ranks[0].buffers
    if not _bf16_gemms_run_on_onednn(capfd):
        assert "cpu_gemm_kernels" not in buffers
        return
    assert buffers["cpu_gemm_kernels"] == 128 * 2**20
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")  # torch's default: the user's
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    assert plan_memory(recipe, 1, device_type="cpu").ranks[0].buffers["cpu_gemm_kernels"] == 512 * 2**20


def test_lora_trains_only_adapters():
    recipe = pu.recipe({}, False, peft={"dim": 4, "alpha": 8, "match_all_linear": True})
    b, trainer = pu.build({}, 1, peft={"dim": 4, "alpha": 8, "match_all_linear": True})
    got = held_at_optimizer_step(b, trainer)
    plan = plan_memory(recipe, 1, device_type="cpu")
    assert_close_10pct(got, planned_bytes(plan, 0), "LoRA")
    assert got["grads"] < 0.5 * got["params"]


def test_squad_recipe_layout_partitions_the_model_once(nano_dir):
    """pp=4 x ep=2 on 8 ranks: the ranks of a pipeline stage hold the same figures, and all
    ranks together hold every parameter once (experts over ep, the rest over dp_shard)."""
    plan = plan_memory(ROOT / "examples" / "nemotron3_nano_squad.yaml", 8)
    assert plan.degrees["pp"] == 4 and plan.degrees["dp_shard"] == 2
    assert sum(r.params for r in plan.ranks) == plan.num_params * 4  # fp32, no replica
    assert len(plan.roles()) == 4
    for r in plan.ranks:
        assert r.grads == r.params and r.optimizer > 2 * r.params
    # activation checkpointing on: every stage holds a recomputed block's backward
    assert all(r.activations_per_micro_batch["backward"] > 0 for r in plan.ranks)
    assert plan.ranks[-1].activations_per_micro_batch["loss"] > 0
    assert "loss" not in plan.ranks[0].activations_per_micro_batch


def test_lora_recipe_fits_80gb_and_layout(nano_dir):
    plan = plan_memory(ROOT / "examples" / "nemotron3_nano_lora_chat.yaml", 8,
                       device_memory=parse_memory("80GB"))
    assert plan.fits and plan.degrees["ep"] == 8
    assert plan.num_trainable < 0.01 * plan.num_params
    assert len(plan.roles()) == 1
    r = plan.ranks[0]
    assert r.grads < 0.02 * r.params


def test_activation_checkpointing_and_micro_batch_lower_activations():
    base = pu.recipe({}, False)
    a = plan_memory(base, 1, device_type="cpu").ranks[0]
    ck = plan_memory(pu.recipe({}, False, ac=True), 1, device_type="cpu").ranks[0]
    assert ck.activations < a.activations
    assert ck.params == a.params and ck.optimizer == a.optimizer


def test_plan_and_run_checkpoint_the_same_blocks_by_type():
    """``[mamba, moe]``: the run wraps exactly the Mamba and MoE blocks, and the plan counts
    those blocks checkpointed (as with ``true``) and the others whole (as with ``false``)."""
    from hybridtrain.distributed.layout import config_section
    from hybridtrain.distributed.parallel_dims import ParallelDims
    from hybridtrain.distributed.parallel_plan import parallelize
    from hybridtrain.models.spec import MemoryPlanSupport
    from hybridtrain.training.builder import as_config

    policy = ["mamba", "moe"]
    spec, model = meta_model(as_config(pu.recipe({}, False, ac=policy)).model)
    parallelize(spec, model, ParallelDims(world_size=1), config_section("distributed"),
                config_section("training", {"activation_checkpointing": policy}),
                device=torch.device("cpu"), autocast_dtype=None)
    chosen = [int(k) for k, b in model.backbone.layers.items()
              if hasattr(b, "_checkpoint_wrapped_module")]
    act = spec.part(MemoryPlanSupport, "plan").activation_bytes(model.config, 1, 8, torch.float32)
    category = [layer.category for layer in act.layers]
    assert {category[i] for i in chosen} == {"mamba", "moe"}
    assert chosen == [i for i, c in enumerate(category) if c in ("mamba", "moe")]

    def per_mb(ac):
        return plan_memory(pu.recipe({}, False, ac=ac), 1,
                           device_type="cpu").ranks[0].activations_per_micro_batch

    typed, every, none = per_mb(policy), per_mb(True), per_mb(False)
    for c in set(category):
        assert typed[c] == (every if c in ("mamba", "moe") else none)[c], c
    assert typed["attention"] > every["attention"] and typed["mamba"] < none["mamba"]


def test_parse_memory():
    assert parse_memory("80GB") == parse_memory("80GiB") == parse_memory("80") == 80 * GiB
    assert parse_memory("512MB") == 512 * 2 ** 20
    with pytest.raises(ValueError, match="device-memory"):
        parse_memory("lots")


def test_cli_plan_json_and_exit_status(nano_dir, capsys):
    recipe = str(ROOT / "examples" / "nemotron3_nano_squad.yaml")
    assert cli.main(["plan", "-c", recipe, "--nproc-per-node", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["ranks"]) == 8 and d["fits"] is None
    rc = cli.main(["plan", "-c", recipe, "--nproc-per-node", "8", "--device-memory", "40GB"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "does NOT fit" in out and "use LoRA" in out and "--distributed.pp=1" in out
    tiny = str(ROOT / "examples" / "squad_tiny.yaml")  # activations dominate: batch advice
    assert cli.main(["plan", "-c", tiny, "--device-memory", "1MB", "--device-type", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "lower micro_batch_size to 1" in out and "activation_checkpointing=true" in out


def _from_pretrained_recipe(local_dir):
    recipe = pu.recipe({}, False)
    recipe["model"] = {
        "_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM.from_pretrained",
        "local_dir": str(local_dir)}
    return recipe


def test_plan_reads_no_weights(tmp_path):
    """A from_pretrained section whose folder holds only config.json plans fine."""
    (tmp_path / "config.json").write_text((NANO / "config.json").read_text())
    recipe = _from_pretrained_recipe(tmp_path)
    recipe["training"]["global_batch_size"] = 16  # micro-batches of 2 on 8 ranks
    plan = plan_memory(recipe, 8, device_type="cuda")
    assert plan.param_dtypes == ["bfloat16"]  # config.json torch_dtype, no dtype given
    assert os.listdir(tmp_path) == ["config.json"]


def test_missing_config_json_is_a_user_error(tmp_path):
    recipe = _from_pretrained_recipe(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        plan_memory(recipe, 1)


@pytest.mark.parametrize("name", ["nemotron3_nano_squad", "nemotron3_nano_lora_chat",
                                  "nemotron3_nano_omni_vlm"])
def test_recipe_comments_state_the_current_plan(nano_dir, name):
    """The 8 x 80 GB figures written in the 30B recipes are what the plan says today."""
    path = ROOT / "examples" / f"{name}.yaml"
    plan = plan_memory(path, 8, device_memory=parse_memory("80GB"))
    text = path.read_text()
    assert plan.within_headroom
    for group in plan.roles():
        r = group[0]
        for value in (r.params, r.grads, r.optimizer, r.activations, sum(r.buffers.values()),
                      r.total):
            assert f"{value / GiB:.2f}" in text, (name, value / GiB)


def test_cpu_offload_moves_states_to_the_host(nano_dir):
    path = ROOT / "examples" / "nemotron3_nano_lora_chat.yaml"
    from hybridtrain.config import load_config

    on = plan_memory(load_config(path, {"distributed.cpu_offload": True}), 8)
    off = plan_memory(path, 8)
    a, b = on.ranks[0], off.ranks[0]
    assert a.host == b.params + b.grads + b.optimizer
    assert a.total == pytest.approx(b.total - a.host)


def test_shard_arithmetic_follows_torch_chunk_and_the_rank_layout():
    from hybridtrain.distributed.parallel_dims import ParallelDims
    from hybridtrain.training.memory_plan import _chunk, _coords

    for n in range(0, 12):
        for parts in range(1, 5):
            ref = [len(c) for c in torch.chunk(torch.arange(n), parts)] if n else []
            got = [_chunk(n, parts, i) for i in range(parts)]
            assert got == ref + [0] * (parts - len(ref)), (n, parts, got, ref)
    dims = ParallelDims(dp_replicate=2, dp_shard=4, pp=2, ep=2, world_size=16)
    grid = torch.arange(16).view(2, 2, 4, 1, 1)  # pp, dp_replicate, dp_shard, cp, tp
    for rank in range(16):
        c = _coords(rank, dims)
        assert grid[c["pp"], c["dp_replicate"], c["dp_shard"], c["cp"], c["tp"]] == rank
        # the expert view (pp, dp_replicate, efsdp, ep, tp) of the same ranks
        assert torch.arange(16).view(2, 2, 2, 2, 1)[
            c["pp"], c["dp_replicate"], c["efsdp"], c["ep"], 0] == rank


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_plan_counts_what_tensor_parallelism_shards(kv_heads):
    """tp 2: the heads' and groups' projections, Mamba's per-head and per-group parameters, the
    embeddings and the head are halved; norms, the router and the routed experts (and k/v when
    there are fewer kv heads than ranks) are whole on each rank."""
    import re

    sections = {}
    if kv_heads:
        sections["model"] = {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM",
                             "config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config",
                                        "kind": "mixed", "num_key_value_heads": kv_heads}}
    recipe = pu.recipe({"tp": 2}, False, **sections)
    plan = plan_memory(recipe, 2, device_type="cpu")
    from hybridtrain.training.builder import as_config

    _, model = meta_model(as_config(recipe).model)
    sharded = (r"embeddings\.weight|lm_head\.weight|(q|o)_proj\.weight|(in|out)_proj\.weight|conv1d\."
               r"|dt_bias|A_log|mixer\.D$|mixer\.norm\.weight|shared_experts\.(up|down)_proj\.weight"
               r"|mixer\.(up|down)_proj\.weight")
    if not kv_heads:
        sharded += r"|(k|v)_proj\.weight"
    want = sum(p.numel() * p.element_size() / (2 if re.search(sharded, n) else 1)
               for n, p in model.named_parameters())
    assert any(re.search(sharded, n) for n, _ in model.named_parameters())
    for r in plan.ranks:
        assert r.params == want, (r.rank, r.params, want)



def test_pipeline_plan_gives_both_reshard_policies_and_advises_always(nano_dir):
    """Under pp the default keeps each stage gathered (and its gradients unsharded) through the
    step; the plan gives the peak under both policies, and over a device memory between them
    advises ``fsdp_reshard_after_forward: always`` (the figures against a real run:
    tests/distributed/test_plan_pipeline_reshard.py)."""
    from hybridtrain.config import load_config
    from hybridtrain.recipes.plan import advise, format_plan

    cfg = load_config(ROOT / "examples" / "nemotron3_nano_squad.yaml",  # pp 4 x ep 2
                      {"distributed.fsdp_reshard_after_forward": "default"})
    plan = plan_memory(cfg, 8)
    peaks = plan.reshard_peaks
    assert set(peaks) == {"default", "always"} and peaks["always"] < peaks["default"] == plan.peak
    assert "always: " in format_plan(plan)
    # a device whose headroom (90 %) lies between the two peaks
    plan = plan_memory(cfg, 8, device_memory=(peaks["always"] + peaks["default"]) / 2 / 0.9)
    assert plan.fits and not plan.within_headroom
    always = [a for a in advise(cfg, 8, plan, "cuda")
              if "fsdp_reshard_after_forward=always" in a["change"]]
    assert always and always[0]["within_headroom"] and always[0]["peak"] == peaks["always"]
    assert plan_memory(pu.recipe({}, False), 1, device_type="cpu").reshard_peaks == {}


@pytest.mark.parametrize("name", ["nemotron3_nano_squad", "nemotron3_nano_lora_chat"])
def test_the_documented_plan_works_without_the_model(name, monkeypatch, capsys):
    """NEMOTRON3_NANO_DIR unset: the recipe's default is the Hub config shipped with the examples,
    so the README's plan command runs as written (from the repository root)."""
    monkeypatch.delenv("NEMOTRON3_NANO_DIR", raising=False)
    monkeypatch.chdir(ROOT)
    assert cli.main(["plan", "-c", f"examples/{name}.yaml", "--nproc-per-node", "8",
                     "--device-memory", "80GB"]) == 0
    assert "fits 80.00 GiB per device" in capsys.readouterr().out


@pytest.mark.parametrize("grids", [[[8, 8]] * 4, [[8, 8], [4, 8], [8, 4], [16, 16]]],
                         ids=["one size", "four sizes"])
def test_vision_estimate_counts_what_the_encoder_keeps(grids):
    """The VLM's vision encoder + projector estimate against the bytes autograd keeps for
    their backward on those images (within 10 %); a frozen encoder keeps the projector's only."""
    from hybridtrain.models.nemotron_vlm import build_vlm, tiny_vlm_config
    from hybridtrain.models.nemotron_vlm.memory import vision_activation_bytes
    from tests.helpers.memory import SavedActivations

    torch.manual_seed(0)
    model = build_vlm(tiny_vlm_config(image_token_id=4, text={"vocab_size": 320}))
    grid = torch.tensor(grids)
    patches = int((grid[:, 0] * grid[:, 1]).sum())
    pixels = torch.randn(patches, model.config.vision_config.patch_dim)
    for trains in (True, False):
        model.vision_model.requires_grad_(trains)
        with SavedActivations(model) as saved:
            model.image_embeddings(pixels, grid)
        est = vision_activation_bytes(model.config, len(grids), patches, torch.float32, trains)
        print(grids, trains, est["vision"], saved.live, est["vision"] / saved.live)
        assert abs(est["vision"] / saved.live - 1) <= 0.10, (trains, est, saved.live)


def _shipped_real_model_runs():
    """(name, recipe, overrides, ranks, device GiB) of every real-model run the examples ship:
    each non-tiny recipe on the GPUs its header names ("Memory plan on N x M GB"), and the Slurm
    script's recipe, ranks and command-line overrides."""
    import re

    runs = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if path.stem.endswith("_tiny"):
            continue
        m = re.search(r"Memory plan on (\d+) x (\d+) GB", path.read_text())
        assert m, f"{path.name} does not name the GPUs it is planned for"
        runs.append((path.stem, path, {}, int(m[1]), int(m[2])))
    for path in sorted((ROOT / "examples").glob("*.sbatch")):
        text = path.read_text()
        ranks = int(re.search(r"--nodes=(\d+)", text)[1]) * int(
            re.search(r"--ntasks-per-node=(\d+)", text)[1])
        recipe = ROOT / re.search(r"-m hybridtrain finetune -c (\S+)", text)[1]
        overrides = dict(re.findall(r"--((?:distributed|training)\.\w+)=(\S+)", text))
        gb = int(re.search(r"Memory plan on \d+ x (\d+) GB", recipe.read_text())[1])
        runs.append((path.name, recipe, overrides, ranks, gb))
    return runs


def test_shipped_real_model_recipes_plan_within_the_headroom(nano_dir):
    """Every real-model run shipped in examples/ (its recipe, its ranks, the GPU it names)
    plans within the headroom rule: at most 90 % of the device memory."""
    from hybridtrain.config import load_config
    from hybridtrain.config.loader import parse_overrides
    from hybridtrain.training.memory_plan import HEADROOM

    runs = _shipped_real_model_runs()
    assert {r[0] for r in runs} >= {"nemotron3_nano_squad", "nemotron3_nano_lora_chat",
                                   "slurm_nemotron3_nano.sbatch"}
    for name, recipe, overrides, ranks, gb in runs:
        cfg = load_config(recipe, parse_overrides([f"--{k}={v}" for k, v in overrides.items()]))
        plan = plan_memory(cfg, ranks, device_memory=gb * GiB)
        print(name, ranks, f"{plan.peak / GiB:.2f} GiB of {gb}")
        assert plan.within_headroom and plan.peak <= HEADROOM * gb * GiB, (name, plan.peak / GiB)


def test_plan_prints_and_applies_the_headroom_rule(nano_dir, capsys):
    """A plan between 90 % and 100 % of the device fits but is flagged (exit status 1, with
    what lowers it); the rule is printed with every device check."""
    recipe = str(ROOT / "examples" / "nemotron3_nano_squad.yaml")  # 70.19 GiB
    assert cli.main(["plan", "-c", recipe, "--nproc-per-node", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "headroom rule: the peak may take 90% of the device memory, 72.00 of 80.00 GiB" in out
    assert "within the headroom" in out
    rc = cli.main(["plan", "-c", recipe, "--nproc-per-node", "8", "--device-memory", "76GB"])
    out = capsys.readouterr().out
    assert rc == 1 and "peak 70.19 GiB: OVER THE HEADROOM: fits 76.00 GiB" in out, out
    assert "what lowers it" in out and "(within the headroom)" in out
    d = plan_memory(recipe, 8, device_memory=parse_memory("76GB")).to_dict()  # --json
    assert d["fits"] and d["within_headroom"] is False and d["limit"] == 0.9 * 76 * GiB


def test_an_encoder_on_its_own_ranks_is_planned_per_side(tmp_path):
    """``encoder_ranks: 2`` beside a language model of tp 2 x ep 2: ranks 0-1 hold the ViT and
    projector FSDP2-sharded between them (their parameter bytes add up to the encoder's), ranks
    2-5 the language model; the printed plan names each side."""
    from hybridtrain.recipes.plan import format_plan
    from tests.helpers import vlm

    plan = plan_memory(vlm.vlm_recipe(str(tmp_path), {"encoder_ranks": 2, "tp": 2, "ep": 2}), 6,
                       device_type="cpu")
    assert [r.role for r in plan.ranks] == ["encoder"] * 2 + ["language model"] * 4
    assert plan.degrees["encoder_ranks"] == 2 and plan.degrees["tp"] == 2
    encoder = sum(p.numel() * 4 for n, p in vlm.hetero_model().named_parameters()
                  if not n.startswith("language_model."))
    assert sum(r.params for r in plan.ranks[:2]) == encoder
    assert all(r.params == plan.ranks[2].params for r in plan.ranks[2:])
    assert "language model" in format_plan(plan)
