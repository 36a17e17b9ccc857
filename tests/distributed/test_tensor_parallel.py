"""Tensor parallelism: the vocab-parallel linear cross-entropy, log-probs (gradcheck, equality
with the full head) and top-k logits, and the Nemotron-H modules sharded by heads and groups."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.distributed import run_cli, run_distributed


def _head_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    n, h, v = 7, 3, 10  # shards of 5 + 5 rows over 2 ranks, 4 + 4 + 2 over 3 (torch.chunk)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[1, 4]] = -100
    return hidden, weight, labels


def _vocab_parallel_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hybridtrain.ops.loss import cross_entropy_sum, token_logprobs, topk_logits

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    hidden, weight, labels = _head_inputs()

    def sharded(w):  # full on every rank -> this rank's vocabulary rows; backward all-gathers
        return DTensor.from_local(w, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(0)])

    out = {}
    for name, fn in {
        "ce": lambda h, w: cross_entropy_sum(h, sharded(w), labels, chunk_size=4),
        "ce_recompute": lambda h, w: cross_entropy_sum(h, sharded(w), labels, chunk_size=4, recompute=True),
        "ce_one_chunk": lambda h, w: cross_entropy_sum(h, sharded(w), labels, chunk_size=None),
        "logprobs": lambda h, w: token_logprobs(h, sharded(w), labels, chunk_size=3),
    }.items():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        y = fn(h, w)
        gy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape) if y.dim() else torch.ones(())
        gh, gw = torch.autograd.grad(y, (h, w), gy)
        out[name] = (y.detach(), gh, gw)
        # finite differences on 2 ranks (recompute=False gives its gradients to one backward only)
        if world == 2 and name in ("ce_recompute", "logprobs"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[name + "_gradcheck"] = torch.autograd.gradcheck(
                    fn, (hidden.clone().requires_grad_(), weight.clone().requires_grad_()),
                    eps=1e-6, atol=1e-7, rtol=1e-5)
    with torch.no_grad():
        out["ce_no_grad"] = cross_entropy_sum(hidden, sharded(weight), labels, chunk_size=4)
    # top-k: k up to the whole vocabulary (more than a 2-row shard holds on 3 ranks)
    out["topk"] = {(k, c): topk_logits(hidden, sharded(weight), k, chunk_size=c) for k in (1, 3, 10)
                   for c in (2, None)}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_cross_entropy_and_logprobs(world):
    from hybridtrain.ops.loss import cross_entropy_sum, token_logprobs

    results = run_distributed(_vocab_parallel_worker, world)
    hidden, weight, labels = _head_inputs()
    for name, ref_fn in {
        "ce": lambda h, w: cross_entropy_sum(h, w, labels, chunk_size=None),
        "ce_recompute": lambda h, w: cross_entropy_sum(h, w, labels, chunk_size=None),
        "ce_one_chunk": lambda h, w: cross_entropy_sum(h, w, labels, chunk_size=None),
        "logprobs": lambda h, w: token_logprobs(h, w, labels, chunk_size=None),
    }.items():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        y = ref_fn(h, w)
        gy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape) if y.dim() else torch.ones(())
        gh, gw = torch.autograd.grad(y, (h, w), gy)
        for r, res in enumerate(results):
            got = res[name]
            torch.testing.assert_close(got[0], y.detach(), rtol=1e-12, atol=1e-12, msg=f"{name} rank {r}")
            torch.testing.assert_close(got[1], gh, rtol=1e-12, atol=1e-12, msg=f"{name} rank {r} d hidden")
            torch.testing.assert_close(got[2], gw, rtol=1e-12, atol=1e-12, msg=f"{name} rank {r} d weight")
            assert res.get(name + "_gradcheck", True) is True
        if name == "ce":
            for res in results:
                torch.testing.assert_close(res["ce_no_grad"], y.detach(), rtol=1e-12, atol=1e-12)
    logits = hidden @ weight.t()  # (no ties in these random logits)
    for (k, c), (values, ids) in results[0]["topk"].items():
        ref_v, ref_i = logits.topk(k, dim=-1)
        for res in results:
            torch.testing.assert_close(res["topk"][k, c][0], ref_v, rtol=1e-12, atol=1e-12)
            assert torch.equal(res["topk"][k, c][1], ref_i), (k, c)


# -- the parity matrix: tensor parallelism through the recipe's builder and trainer ---------------
# (one launch per world size; the single-process references once)
from tests.helpers import parity as pu  # noqa: E402

SAVE_AT = pu.SAVE_AT
ONE_KV_HEAD = {"model": {"_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM",
                         "config": {"_target_": "hybridtrain.models.nemotron_h.tiny_config",
                                    "kind": "mixed", "num_key_value_heads": 1}}}
LAYOUTS = {"tp2": ({"tp": 2}, 2), "tp2_pp2": ({"tp": 2, "pp": 2}, 4), "tp2_ep2": ({"tp": 2, "ep": 2}, 4)}


def _two_rank_group(rank, world, ckpt):
    """Everything of 2 ranks in one launch: TP=2 unpacked and packed, TP=2 with one kv head,
    TP=2 saved at step ``SAVE_AT``, resumed from the one-process checkpoint, and with
    activation checkpointing."""
    layout = LAYOUTS["tp2"][0]
    return {"tp2": {packed: pu.run_layout(layout, world, packed) for packed in (False, True)},
            "one_kv": pu.run_layout(layout, world, False, **ONE_KV_HEAD),
            "save_tp2": pu.train_and_save(layout, world, f"{ckpt}/tp2", SAVE_AT),
            "single->tp2": pu.resume_and_train(layout, world, f"{ckpt}/single"),
            "tp2_ac": pu.run_layout(layout, world, False, ac=True)[0]}


def _four_rank_group(rank, world):
    return {name: {packed: pu.run_layout(layout, world, packed) for packed in (False, True)}
            for name, (layout, w) in LAYOUTS.items() if w == 4}


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return {packed: pu.reference(packed) for packed in (False, True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Rank 0's results of one 2-rank launch, plus the one-process save and the one-process
    resume of the TP=2 checkpoint."""
    torch.set_num_threads(1)
    ckpt = str(tmp_path_factory.mktemp("tp_ckpt"))
    saved_single = pu.train_and_save({}, 1, f"{ckpt}/single", SAVE_AT)
    out = run_distributed(_two_rank_group, 2, ckpt)[0]
    out["saved_single"] = saved_single
    out["tp2->single"] = pu.resume_and_train({}, 1, f"{ckpt}/tp2")
    return out


@pytest.fixture(scope="module")
def runs4():
    """Rank 0's results of one 4-rank launch (on a worker of its own under xdist)."""
    return run_distributed(_four_rank_group, 4)[0]


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _check(name, got, ref):
    """Per-step losses and gradient norms, validation loss within 1e-5 relative; final weights
    within 1e-5 relative (norm of the difference per tensor: Adam turns last-bit differences of
    near-zero gradient entries into whole lr-sized steps, so single entries can differ by ~1e-5)."""
    losses, w, val, norms = got
    ref_losses, ref_w, ref_val, ref_norms = ref
    rel, rel_norm = _max_rel(losses, ref_losses), _max_rel(norms, ref_norms)
    assert set(w) == set(ref_w)
    dw = max(float((w[k] - ref_w[k]).norm() / ref_w[k].norm()) for k in ref_w)
    print(f"{name:22s} loss rel {rel:.2e} grad-norm rel {rel_norm:.2e} weights rel {dw:.2e} "
          f"val rel {abs(val - ref_val) / ref_val:.2e}")
    assert rel <= 1e-5, (losses, ref_losses)
    assert rel_norm <= 1e-5, (norms, ref_norms)
    assert dw <= 1e-5
    assert abs(val - ref_val) <= 1e-5 * ref_val


@pytest.mark.distributed
@pytest.mark.parametrize("name", [name if w == 2 else pytest.param(
    name, marks=pytest.mark.xdist_group("tensor_parallel_4_ranks")) for name, (_, w) in LAYOUTS.items()])
def test_tp_layout_matches_single_process(request, reference, name):
    runs = request.getfixturevalue("runs" if LAYOUTS[name][1] == 2 else "runs4")
    for packed in (False, True):
        _check(f"{name} {'packed' if packed else 'unpacked'}", runs[name][packed], reference[packed])


@pytest.mark.distributed
def test_tp2_with_fewer_kv_heads_than_ranks(runs):
    torch.set_num_threads(1)
    ref = pu.run_layout({}, 1, False, **ONE_KV_HEAD)
    _check("tp2, 1 kv head", runs["one_kv"], ref)


@pytest.mark.distributed
def test_checkpoint_resumes_across_tp_layouts(reference, runs):
    """TP=2 -> one process and one process -> TP=2 (checkpoints hold full tensors); TP=2 with
    activation checkpointing."""
    ref_losses = reference[False][0]
    assert _max_rel(runs["saved_single"], ref_losses[:SAVE_AT]) <= 1e-5
    assert _max_rel(runs["save_tp2"], ref_losses[:SAVE_AT]) <= 1e-5
    for flow in ("tp2->single", "single->tp2"):
        assert _max_rel(runs[flow], ref_losses[SAVE_AT:]) <= 1e-5, (flow, runs[flow], ref_losses[SAVE_AT:])
    assert _max_rel(runs["tp2_ac"], ref_losses) <= 1e-5


@pytest.mark.distributed
def test_cli_tp2_trains_and_exports_like_one_process(tmp_path):
    """`hybridtrain finetune --distributed.tp=2` on 2 ranks: per-step losses as one process, and
    the HF export (full tensors, Hub row order) equal to one process's."""
    import json

    import yaml
    from safetensors.torch import load_file

    from hybridtrain.cli import main
    from tests.helpers.recipes import run_overrides, tiny_recipe

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(training={"max_steps": 3})))
    args = ["finetune", "-c", str(recipe)]
    assert main(args + run_overrides(tmp_path / "single", 3)) == 0
    run_cli([*args, "--distributed.tp=2", *run_overrides(tmp_path / "tp2", 3)], 2, tmp_path)

    def records(run):
        return [json.loads(line) for line in open(tmp_path / run / "training.jsonl")]

    ref, got = records("single"), records("tp2")
    assert len(got) == len(ref) == 3
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], (got, ref)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (got, ref)
    w_ref = load_file(tmp_path / "single" / "final" / "hf" / "model.safetensors")
    w_tp = load_file(tmp_path / "tp2" / "final" / "hf" / "model.safetensors")
    assert set(w_ref) == set(w_tp)
    for k in w_ref:
        assert (w_tp[k] - w_ref[k]).norm() <= 1e-5 * w_ref[k].norm(), k
