"""Loss/weight parity of parallel layouts against the single-process run (tiny MoE Nemotron-H).

A run: the tiny 'mixed' model (Mamba, attention, MLP and MoE layers), AdamW, gradient clipping,
``STEPS`` optimizer steps over fixed global batches of ``GBS`` rows (unpacked rows of uneven
label counts, or packed rows of several documents). The loop follows the trainer's arithmetic:
label tokens counted over the global batch, CE sums scaled by 1/count, summed over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridtrain.data.batch import IGNORE_INDEX as IGNORE
from hybridtrain.distributed.parallel_dims import ParallelDims

STEPS = 5
GBS = 8
MBS = 2
SEQ = 16
LR = 2e-4


def make_model(seed: int = 0):
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    torch.manual_seed(seed)
    return NemotronHForCausalLM(tiny_config("mixed"))


def _docs_row(g: torch.Generator, vocab: int, packed: bool):
    ids = torch.randint(1, vocab, (SEQ,), generator=g)
    labels = torch.full((SEQ,), IGNORE)
    if not packed:
        prompt = int(torch.randint(1, SEQ // 2, (), generator=g))
        labels[prompt - 1 : SEQ - 1] = ids[prompt:]
        return ids, labels, torch.arange(SEQ), [SEQ]
    cuts = sorted(torch.randperm(SEQ - 2, generator=g)[:2].add(1).tolist())
    lens = [cuts[0], cuts[1] - cuts[0], SEQ - cuts[1]]
    pos, start = [], 0
    for n in lens:
        pos.append(torch.arange(n))
        labels[start : start + n - 1] = ids[start + 1 : start + n]  # no label across documents
        start += n
    return ids, labels, torch.cat(pos), lens


def global_batches(packed: bool, vocab: int = 256, seed: int = 1234) -> list[list[dict]]:
    """``STEPS`` global batches, each a list of ``GBS`` single-row samples."""
    g = torch.Generator().manual_seed(seed + int(packed))
    out = []
    for _ in range(STEPS):
        rows = []
        for _ in range(GBS):
            ids, labels, pos, lens = _docs_row(g, vocab, packed)
            rows.append({"input_ids": ids, "labels": labels, "position_ids": pos, "lens": lens})
        out.append(rows)
    return out


def collate(rows: list[dict], packed: bool) -> dict:
    b = {
        "input_ids": torch.stack([r["input_ids"] for r in rows]),
        "labels": torch.stack([r["labels"] for r in rows]),
        "position_ids": torch.stack([r["position_ids"] for r in rows]),
    }
    if packed:  # as the packed collator: cumulative lengths over the flattened rows
        cu = [0]
        for r in rows:
            for n in r["lens"]:
                cu.append(cu[-1] + n)
        b["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    return b


def micro_batches(step_rows: list[dict], dp_rank: int, dp_size: int, packed: bool) -> list[dict]:
    """The step scheduler's assignment: micro-step i takes dp_size*MBS rows, rank r its slice."""
    ga = GBS // (MBS * dp_size)
    out = []
    for i in range(ga):
        lo = i * dp_size * MBS + dp_rank * MBS
        out.append(collate(step_rows[lo : lo + MBS], packed))
    return out


def ce_sum(hidden, weight, labels, recompute: bool = False):
    from hybridtrain.ops.loss import cross_entropy_sum

    return cross_entropy_sum(hidden, weight, labels, recompute=recompute)


def train_step(plan):
    """The recipe's train step for ``plan`` (fp32: no autocast)."""
    from hybridtrain.recipes.finetune import make_train_step

    return make_train_step(plan, chunk_size=None, autocast_dtype=None)


def train(plan, steps_rows, packed: bool, optimizer=None, start: int = 0, steps: int = STEPS):
    """The trainer's step arithmetic over ``plan``; returns (losses, optimizer)."""
    model = plan.model
    step_fn = train_step(plan)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=True)
    losses, norms = [], []
    for step in range(start, start + steps):
        mbs = micro_batches(steps_rows[step], plan.dp_rank, plan.dp_size, packed)
        counts = torch.tensor([float(sum(int((mb["labels"] != IGNORE).sum()) for mb in mbs))],
                              dtype=torch.float64)
        if plan.dp_group is not None:
            dist.all_reduce(counts, group=plan.dp_group)
        n = int(counts[0])
        ce = step_fn(model, mbs, n).to(torch.float64).reshape(1)
        if plan.dp_group is not None:
            dist.all_reduce(ce, group=plan.dp_group)
        norms.append(float(plan.clip_grad_norm(params, 1.0)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(ce[0]) / n)
    train.grad_norms = norms  # the last run's pre-clipping gradient norms
    return losses, optimizer


def evaluate(plan, rows: list[dict], packed: bool) -> float:
    """Token-weighted CE of ``rows`` (split over data-parallel ranks) without gradients."""
    per = len(rows) // plan.dp_size
    batch = collate(rows[plan.dp_rank * per : (plan.dp_rank + 1) * per], packed)
    ce = train_step(plan).eval_loss(plan.model, batch).to(torch.float64).reshape(1)
    n = torch.tensor([float((batch["labels"] != IGNORE).sum())], dtype=torch.float64)
    if plan.dp_group is not None:
        dist.all_reduce(ce, group=plan.dp_group)
        dist.all_reduce(n, group=plan.dp_group)
    return float(ce[0] / n[0])


def full_state(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters of this rank's part of the model."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.clone()
    return out


def gather_state(model) -> dict[str, torch.Tensor] | None:
    """Every rank's parameters merged (pipeline stages hold different layers)."""
    local = full_state(model)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged = {}
    for p in parts:
        merged.update(p)
    return merged


def build(layout: dict, world: int, ac=None):
    from hybridtrain.models.nemotron_h.parallelize import parallelize_nemotron_h

    degrees = {k: layout[k] for k in ("dp_replicate", "dp_shard", "pp", "ep") if k in layout}
    dims = ParallelDims(world_size=world, **degrees)
    if world > 1:
        dims.build_mesh("cpu")
    model = make_model()
    plan = parallelize_nemotron_h(
        model, dims, loss_fn=ce_sum, activation_checkpointing=ac,
        pp_schedule=layout.get("schedule", "1f1b"),
        pp_stages_per_rank=layout.get("stages_per_rank"),
    )
    return plan


def reference(packed: bool):
    """Single-process run through the model's own forward (``hidden_states`` + chunked CE)."""
    from types import SimpleNamespace

    model = make_model()
    rows = global_batches(packed)

    def loss_fn(m, b):
        kw = {k: b[k] for k in ("position_ids", "cu_seqlens") if k in b}
        return ce_sum(m.hidden_states(b["input_ids"], **kw), m.lm_head.weight, b["labels"])

    def clip(params, max_norm):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    plan = SimpleNamespace(model=model, loss_fn=loss_fn, grad_sync_module=None, pipeline=None,
                           dp_rank=0, dp_size=1, dp_group=None, clip_grad_norm=clip)
    losses, _ = train(plan, rows, packed)
    return losses, full_state(model), evaluate(plan, rows[0], packed), train.grad_norms


def run_layout(layout: dict, world: int, packed: bool, ac=None):
    """(per-step losses, final full weights (rank 0), validation loss, per-step gradient norms)
    of one layout."""
    plan = build(layout, world, ac=ac)
    rows = global_batches(packed)
    losses, _ = train(plan, rows, packed)
    norms = train.grad_norms
    state = gather_state(plan.model)
    val = evaluate(plan, rows[0], packed)
    return losses, state if dist.get_rank() == 0 else None, val, norms


def train_and_save(layout: dict, world: int, path: str, steps: int, packed: bool = False):
    """Train ``steps`` steps under ``layout`` and write a checkpoint (step_{steps}/)."""
    from hybridtrain.training.checkpoint import Checkpointer

    plan = build(layout, world)
    losses, opt = train(plan, global_batches(packed), packed, steps=steps)
    Checkpointer(path).save(steps, plan.model, opt)
    return losses


def resume_and_train(layout: dict, world: int, path: str, start: int, packed: bool = False):
    """Load ``path`` (any layout's checkpoint) under ``layout`` and train the remaining steps."""
    from hybridtrain.training.checkpoint import Checkpointer

    plan = build(layout, world)
    params = [p for p in plan.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=True)
    ck = Checkpointer(path)
    ck.load(ck.latest(), plan.model, opt)
    losses, _ = train(plan, global_batches(packed), packed, optimizer=opt, start=start,
                      steps=STEPS - start)
    return losses
