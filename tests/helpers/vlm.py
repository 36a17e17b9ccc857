"""The tiny vision-language recipe for tests: a BPE tokenizer with ``<image>``, synthetic
shapes (images of several sizes, text-only samples mixed in), the tiny VLM; built and trained
by the recipe's own builder and trainer (the layout-parity helpers' batches and loop)."""

from __future__ import annotations

import copy

import torch.distributed as dist

from . import parity

IMAGE_TOKEN_ID = 4  # <image>: the first token after the tokenizer's four chat/special tokens


def vlm_recipe(tmp: str, layout: dict | None = None, packed: bool = False,
               freeze: list[str] = (), **sections) -> dict:
    n = 200 if packed else 64
    recipe = {
        "tokenizer": {"_target_": "hybridtrain.data.build_bpe_tokenizer",
                      "texts": {"_target_": "hybridtrain.data.shapes_texts"},
                      "out_dir": f"{tmp}/tokenizer", "vocab_size": 300,
                      "extra_special_tokens": ["<image>"]},
        "model": {"_target_": "hybridtrain.models.nemotron_vlm.build_vlm",
                  "config": {"_target_": "hybridtrain.models.nemotron_vlm.tiny_vlm_config",
                             "image_token_id": IMAGE_TOKEN_ID, "text": {"vocab_size": 320}},
                  "freeze": list(freeze)},
        "dataset": {"_target_": "hybridtrain.data.build_vision_chat_dataset",
                    "path": {"_target_": "hybridtrain.data.write_synthetic_shapes",
                             "out_dir": f"{tmp}/data", "n": n, "seed": 0, "text_only": 0.3},
                    "patch_size": 4, "min_patches": 16, "max_patches": 64},
        "validation_dataset": {"_target_": "hybridtrain.data.build_vision_chat_dataset",
                               "path": {"_target_": "hybridtrain.data.write_synthetic_shapes",
                                        "out_dir": f"{tmp}/val", "n": 16, "seed": 1},
                               "patch_size": 4, "min_patches": 16, "max_patches": 64},
        "packing": {"enabled": packed, "pack_size": 128},
        "distributed": dict(layout or {}),
        "training": {"device": "cpu", "dtype": "float32", "seed": 0, "grad_clip": 1.0,
                     "global_batch_size": parity.GBS, "micro_batch_size": parity.MBS,
                     "max_steps": parity.STEPS},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "metrics": {"progress_bar": False, "plot": False, "peak_tflops": 1.0},
    }
    for name, values in sections.items():
        recipe.setdefault(name, {}).update(values)
    return recipe


def build(tmp: str, layout: dict | None = None, world: int = 1, packed: bool = False,
          freeze=(), checkpoint_dir: str | None = None, **sections):
    """(``Built``, ``Trainer``) of the tiny VLM recipe (``sections`` update the recipe's)."""
    from hybridtrain.training.builder import build as build_recipe
    from hybridtrain.training.builder import build_lr_scheduler, make_trainer
    from hybridtrain.training.checkpoint import Checkpointer
    from hybridtrain.training.step_scheduler import StepScheduler

    rank = dist.get_rank() if dist.is_initialized() else 0
    b = build_recipe(vlm_recipe(tmp, layout, packed, freeze, **sections), "cpu", is_main=rank == 0,
                     world_size=world)
    t = b.cfg.training
    sched = StepScheduler(t.global_batch_size, t.micro_batch_size, dp_size=b.plan.dims.dp,
                          max_steps=t.max_steps, num_train_samples=len(b.data.train), seed=t.seed)
    lr = build_lr_scheduler(b.cfg, b.optimizer, sched.max_steps, sched.global_batch_size)
    ck = Checkpointer(checkpoint_dir) if checkpoint_dir else None
    return b, make_trainer(b, sched, lr, ck)


def run(tmp: str, layout: dict | None = None, world: int = 1, packed: bool = False, freeze=()):
    """(per-step losses, full weights on rank 0, validation loss, per-step gradient norms) of
    the tiny VLM recipe."""
    b, trainer = build(tmp, layout, world, packed, freeze)
    losses, norms = parity.train(b, trainer)
    state = parity.gather_state(b.model)
    val = trainer.validate()["val_loss"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    return losses, state if rank == 0 else None, val, norms


_ONCE: dict[tuple, object] = {}


def _once(key: tuple, fn):
    """``fn()`` computed once per test process for ``key`` (one-process references the test
    files share, in the session's data directory: the ``vlm_dir`` fixture); a copy each call."""
    if key not in _ONCE:
        import torch

        torch.set_num_threads(1)
        _ONCE[key] = fn()
    return copy.deepcopy(_ONCE[key])


def reference(tmp: str, packed: bool = False, freeze=()):
    """:func:`run` in one process (computed once per process and arguments)."""
    freeze = tuple(freeze)
    return _once(("run", tmp, packed, freeze), lambda: run(tmp, None, 1, packed, freeze))


def colocated_checkpoint(tmp: str, ckpt: str) -> str:
    """``ckpt``/colocated: the one-process run saved at step ``parity.SAVE_AT`` (written once
    per process and directories); returns its path."""
    path = f"{ckpt}/colocated"
    _once(("colocated", tmp, path),
          lambda: train_and_save(tmp, None, 1, path, parity.SAVE_AT))
    return path


# -- the heterogeneous layout: a hand-written loop of the trainer's step ----------------------
def hetero_data(tmp: str):
    """(tokenizer-built dataset, collator) of the tiny VLM recipe's training data."""
    from hybridtrain.data import build_bpe_tokenizer, build_collator, build_vision_chat_dataset
    from hybridtrain.data import load_tokenizer, shapes_texts, write_synthetic_shapes

    import os

    if not os.path.isdir(f"{tmp}/tokenizer"):
        build_bpe_tokenizer(shapes_texts(), f"{tmp}/tokenizer", vocab_size=300,
                            extra_special_tokens=["<image>"])
    if not os.path.exists(f"{tmp}/data/data.jsonl"):
        write_synthetic_shapes(f"{tmp}/data", 64, seed=0, text_only=0.3)
    ds = build_vision_chat_dataset(f"{tmp}/data/data.jsonl", load_tokenizer(f"{tmp}/tokenizer"),
                                   patch_size=4, min_patches=16, max_patches=64)
    return ds, build_collator(ds)


def hetero_model(freeze=()):
    import torch

    from hybridtrain.models.nemotron_vlm import build_vlm, tiny_vlm_config
    from hybridtrain.models.spec import set_train_loss
    from hybridtrain.ops.loss import LinearCrossEntropy

    torch.manual_seed(0)
    model = build_vlm(tiny_vlm_config(image_token_id=IMAGE_TOKEN_ID, text={"vocab_size": 320}),
                      freeze=freeze)
    set_train_loss(model, LinearCrossEntropy(reduction="sum"))
    return model.train()


def lane_batches(ds, collate, step: int, lanes: int, lane: int) -> list[dict]:
    """Lane ``lane``'s micro-batches of global batch ``step`` (as the step scheduler splits)."""
    G, M = parity.GBS, parity.MBS
    first = step * G
    return [collate([ds[first + i * lanes * M + lane * M + j] for j in range(M)])
            for i in range(G // (M * lanes))]


def side_batches(plan, ds, collate, step: int) -> list[dict]:
    """This rank's micro-batches of global batch ``step`` of the heterogeneous layout, read
    through the plan's data view (a lane: its samples without pixels; an encoder rank: the
    images of the lanes it serves)."""
    from hybridtrain.training.step_scheduler import MicroBatchSampler

    lanes = plan.dims.dp
    ga = parity.GBS // (parity.MBS * lanes)
    sampler = MicroBatchSampler(len(ds), parity.MBS, ga, plan.dims.dp_rank, lanes,
                                start_step=step, shuffle=False)
    side, side_sampler, side_collate = plan.data_view(ds, sampler, collate)
    keys = iter(side_sampler)
    return [side_collate([side[k] for k in next(keys)]) for _ in range(ga)]


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1) if params else None


def reference_run(tmp: str, freeze=(), steps: int = parity.STEPS):
    """One process: (losses, grad norms, final weights); computed once per process and
    arguments."""
    freeze = tuple(freeze)
    return _once(("hetero", tmp, freeze, steps), lambda: _reference_run(tmp, freeze, steps))


def _reference_run(tmp: str, freeze, steps: int):
    from hybridtrain.data.batch import count_label_tokens, model_inputs
    from hybridtrain.distributed.utils import clip_grad_norm_

    ds, collate = hetero_data(tmp)
    model = hetero_model(freeze)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _adamw(params)
    losses, norms = [], []
    for s in range(steps):
        mbs = lane_batches(ds, collate, s, 1, 0)
        n = sum(count_label_tokens(mb) for mb in mbs)
        total = 0.0
        for mb in mbs:
            ce = model(mb["input_ids"], labels=mb["labels"], **model_inputs(mb))
            (ce / n).backward()
            total += float(ce.detach())
        norm = clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / n)
        norms.append(float(norm))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def hetero_run(rank: int, world: int, tmp: str, encoders: int, freeze=(),
               steps: int = parity.STEPS):
    """One rank of the heterogeneous layout: (losses, grad norms, owned weights, bytes sent
    per step)."""
    import math

    import torch

    from hybridtrain.data.batch import count_label_tokens
    from hybridtrain.models.nemotron_vlm.hetero import hetero_plan

    from hybridtrain.config import build_config

    ds, collate = hetero_data(tmp)
    model = hetero_model(freeze)
    section = build_config({"distributed": {"encoder_ranks": encoders}})["distributed"]
    plan = hetero_plan(model, section, world)
    step, model = plan.pipeline, plan.model
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    losses, norms = [], []
    for s in range(steps):
        mbs = side_batches(plan, ds, collate, s)
        counts = torch.tensor([float(sum(count_label_tokens(mb) for mb in mbs))],
                              dtype=torch.float64)
        n = int(plan.dims.all_reduce_dp(counts)[0])
        ce = step(model, mbs, n)
        loss = float(plan.dims.all_reduce_dp(ce.double().reshape(1))[0]) / n
        norm = plan.clip_grad_norm(model.parameters(), 1.0)
        if opt is not None and math.isfinite(loss) and math.isfinite(float(norm)):
            opt.step()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        losses.append(loss)
        norms.append(float(norm))
    owned = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in model.state_dict().items()}  # the language model may be sharded
    return losses, norms, owned, step.bytes_sent / steps


def train_and_save(tmp: str, layout: dict | None, world: int, path: str, steps: int):
    """Train ``steps`` steps of the recipe under ``layout`` and save the trainer's checkpoint."""
    b, trainer = build(tmp, layout, world, checkpoint_dir=path)
    losses, _ = parity.train(b, trainer, steps=steps)
    trainer.save_checkpoint()
    return losses


def resume_and_train(tmp: str, layout: dict | None, world: int, path: str):
    """Resume the trainer from ``path`` (any layout's checkpoint); train the remaining steps."""
    b, trainer = build(tmp, layout, world, checkpoint_dir=path)
    trainer.resume(trainer.checkpointer.latest())
    start = trainer.sched.step
    return parity.train(b, trainer, start=start, steps=parity.STEPS - start)[0]


def hetero_group(rank: int, world: int, tmp: str, encoders: int, ckpt: str):
    """The recipe's trainer under ``distributed.encoder_ranks``: a ``parity.STEPS``-step run, a
    run saved at step ``parity.SAVE_AT`` and a run resumed from the colocated checkpoint in
    ``ckpt/colocated``."""
    layout = {"encoder_ranks": encoders}
    return {"run": run(tmp, layout, world),
            "save": train_and_save(tmp, layout, world, f"{ckpt}/hetero{encoders}", parity.SAVE_AT),
            "resume": resume_and_train(tmp, layout, world, f"{ckpt}/colocated")}


def assert_run_matches(got, ref, name: str) -> None:
    """A run's (losses, full weights, validation loss, gradient norms) against the one-process
    ``ref``: per-step loss and gradient norm within 1e-5 relative, validation loss within 1e-5
    relative, and each weight tensor's difference within 1e-5 of its norm, or of 1 where its norm
    is below 1. (AdamW turns last-bit differences of near-zero gradient entries into steps of up to
    the learning rate: relative to its own norm, a bias of norm 0.016 that three steps of lr 1e-3
    moved from zero differed by 1.3e-5 under tp 2 x ep 2 on an AMD EPYC, 8.9e-8 at most per entry.)"""
    losses, state, val, norms = got
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref[0]))
    rel_norm = max(abs(a - b) / abs(b) for a, b in zip(norms, ref[3]))
    assert set(state) == set(ref[1])
    dw, worst = max((float((state[k] - v).norm()) / max(float(v.norm()), 1.0), k) for k, v in ref[1].items())
    print(f"{name}: loss rel {rel:.2e} grad-norm rel {rel_norm:.2e} weights {dw:.2e} ({worst}) "
          f"val rel {abs(val - ref[2]) / abs(ref[2]):.2e}")
    assert rel <= 1e-5 and rel_norm <= 1e-5 and dw <= 1e-5, worst
    assert abs(val - ref[2]) <= 1e-5 * abs(ref[2])
