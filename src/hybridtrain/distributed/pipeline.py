"""Pipeline parallelism on ``torch.distributed.pipelining``: schedules, stage split, train step.

* **Schedules** (``distributed.pp_schedule``, case and ``_``/``-`` insensitive): ``1f1b``,
  ``gpipe``, ``interleaved1f1b``, ``loopedbfs``, ``interleavedzb``, ``zbv`` and ``dualpipev``.
  Single-stage schedules run one stage per rank; the multi-stage ones default to 2 stages per
  rank (``distributed.pp_stages_per_rank``). Stage ``s`` lives on rank ``s % pp`` ("loop"),
  except for the V schedules (``zbv``, ``dualpipev``), where rank ``r`` holds stages ``r`` and
  ``2·pp-1-r``.
* **Stage split**: contiguous layer ranges balancing a per-layer cost (the first stage also
  pays for the embeddings, the last for ``norm_f`` + the LM head), or a manual override
  (``distributed.pp_split_points``: the first layer of every stage after the first).
* **Train step** (:class:`PipelineTrainStep`): one ``schedule.step`` per global batch; the
  trainer's micro-batches of the step become the pipeline's micro-batches (or, with
  ``distributed.pp_microbatch_size``, the step's rows are re-split into micro-batches of that
  many rows). The last stage
  computes each micro-batch's cross-entropy *sum*; the schedule back-propagates
  ``sum / label tokens of the global batch`` (``scale_grads=False``), so gradients equal the
  single-process ones. The last stage keeps no outputs (``return_outputs=False``); the loss
  sum is then all-reduced over the ``pp`` group so every rank logs it.

Every stage receives ``position_ids`` (document boundaries of packed rows; derived from
``cu_seqlens`` when only those are given) and ``labels`` as keyword inputs, split into
micro-batches along the batch dimension like ``input_ids`` (with a model spec's
``pipeline_row_inputs``, also the model's further per-row inputs, e.g. each row's images for
an encoder on the first stage). All micro-batches of a step share
one sequence length: shorter ones are right-padded (labels ``-100``, positions continuing, so
nothing real changes); the pipeline keeps one schedule per sequence length it has seen.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridtrain.data.batch import IGNORE_INDEX

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "resolve_schedule",
    "stage_ids_for_rank",
    "balanced_split",
    "split_from_points",
    "PipelineTrainStep",
    "pipeline_layout",
    "build_schedule",
    "StagePosition",
    "micro_batches_in_flight",
]


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    cls_name: str
    multi: bool  # several stages per rank
    style: str  # "loop" or "v"
    split_backward: bool = False  # zero-bubble: input and weight gradients in two passes


SCHEDULES: dict[str, ScheduleSpec] = {
    "1f1b": ScheduleSpec("1f1b", "Schedule1F1B", False, "loop"),
    "gpipe": ScheduleSpec("gpipe", "ScheduleGPipe", False, "loop"),
    "interleaved1f1b": ScheduleSpec("interleaved1f1b", "ScheduleInterleaved1F1B", True, "loop"),
    "loopedbfs": ScheduleSpec("loopedbfs", "ScheduleLoopedBFS", True, "loop"),
    "interleavedzb": ScheduleSpec("interleavedzb", "ScheduleInterleavedZeroBubble", True, "loop",
                                  True),
    "zbv": ScheduleSpec("zbv", "ScheduleZBVZeroBubble", True, "v", True),
    "dualpipev": ScheduleSpec("dualpipev", "ScheduleDualPipeV", True, "v", True),
}
_SCHEDULE_ALIASES = {
    "interleavedzerobubble": "interleavedzb",
    "zbvzerobubble": "zbv",
}


def resolve_schedule(name: str) -> ScheduleSpec:
    """``ScheduleSpec`` of a schedule name; ``ValueError`` listing the valid ones."""
    key = str(name).lower().replace("_", "").replace("-", "").replace("schedule", "")
    key = _SCHEDULE_ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(
            f"distributed.pp_schedule: unknown pipeline schedule {name!r}; valid schedules are "
            f"{', '.join(SCHEDULES)}"
        )
    return SCHEDULES[key]


def _schedule_class(spec: ScheduleSpec):
    import torch.distributed.pipelining.schedules as s

    cls = getattr(s, spec.cls_name, None)
    if cls is None:  # pragma: no cover - depends on torch version
        raise ValueError(
            f"pipeline schedule {spec.name!r} needs torch.distributed.pipelining."
            f"{spec.cls_name}, which torch {torch.__version__} does not have"
        )
    return cls


def build_schedule(spec: ScheduleSpec, stages: Sequence, n_microbatches: int, loss_fn):
    """torch's schedule of ``spec`` over this rank's ``stages`` (``PipelineStage`` objects, or
    :class:`StagePosition` objects to read its order without running it); ``ValueError`` when it
    does not take ``n_microbatches``. The run and ``hybridtrain plan`` both build it here."""
    cls = _schedule_class(spec)
    try:
        return cls(list(stages) if spec.multi else stages[0], n_microbatches=n_microbatches,
                   loss_fn=loss_fn, scale_grads=False)
    except ValueError as e:
        raise ValueError(
            f"pipeline schedule {spec.name!r} with pp={stages[0].group_size} and "
            f"{n_microbatches} micro-batches per step: {e}"
        ) from None


@dataclass
class StagePosition:
    """Where a pipeline stage sits, as torch's schedules read it from a ``PipelineStage``
    (its public attributes) to lay out their order: the order of a layout can be read without
    process groups (``hybridtrain plan``). ``submod``: the stage's module (an empty one will
    do: the order does not depend on it)."""

    stage_index: int
    num_stages: int
    group_rank: int
    group_size: int
    submod: nn.Module = dataclasses.field(default_factory=nn.Module)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def _most_held(actions, stage: int | None = None) -> int:
    """The most stage-micro-batches (of ``stage`` only, when given) whose forward has run and
    whose backward (full, or the weight pass of a split one) has not, over a rank's
    ``actions`` in order."""
    held = most = 0
    for action in actions:
        for a in (() if action is None else action.sub_actions or (action,)):
            if stage is not None and a.stage_index != stage:
                continue
            if a.computation_type == "F":
                held += 1
                most = max(most, held)
            elif a.computation_type in ("B", "W"):
                held -= 1
    return most


def micro_batches_in_flight(schedule: str, pp: int, pp_rank: int, stages_per_rank: int,
                            n_microbatches: int, stage: int | None = None) -> float:
    """Micro-batches whose activations pp rank ``pp_rank`` holds at once (in units of the
    rank's whole part: a stage-micro-batch of a rank running ``v`` stages counts ``1/v``; of
    its ``stage`` alone, when given): read from the order (``pipeline_order``) of the schedule
    :func:`build_schedule` makes for the run. What ``hybridtrain plan`` multiplies one
    micro-batch's activations by."""
    spec = resolve_schedule(schedule)
    num_stages = pp * stages_per_rank
    stages = [StagePosition(s, num_stages, pp_rank, pp)
              for s in stage_ids_for_rank(pp_rank, pp, stages_per_rank, spec.style)]
    try:
        order = build_schedule(spec, stages, n_microbatches, loss_fn=_no_loss).pipeline_order
    except (AttributeError, TypeError) as e:  # pragma: no cover - depends on torch version
        raise RuntimeError(f"torch {torch.__version__}: {spec.cls_name} reads a pipeline stage "
                           f"differently ({e}); hybridtrain plan cannot read its order") from None
    assert order and pp_rank in order, f"{spec.cls_name} gives no pipeline_order"
    if stage is not None:
        return float(_most_held(order[pp_rank], stage))
    return _most_held(order[pp_rank]) / stages_per_rank


def _no_loss(output, target):  # pragma: no cover - a schedule read for its order only
    raise AssertionError("not run")


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int, style: str) -> list[int]:
    """The stage indices rank ``pp_rank`` runs, in increasing order."""
    if style == "v":
        assert stages_per_rank == 2, "V schedules run exactly 2 stages per rank"
        return sorted([pp_rank, 2 * pp - 1 - pp_rank])
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def stage_rank(stage: int, pp: int, style: str) -> int:
    """The pp rank that runs ``stage``."""
    if style == "v" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def balanced_split(
    costs: Sequence[float],
    num_stages: int,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[tuple[int, int]]:
    """Split layers ``0..N-1`` into ``num_stages`` contiguous non-empty ranges ``[start, end)``
    minimising the largest stage cost (the first stage also costs ``first_extra``, the last
    ``last_extra``). Exact dynamic programme; ties go to the earlier split."""
    n = len(costs)
    if num_stages > n:
        raise ValueError(
            f"pipeline: {num_stages} stages need at least {num_stages} layers, the model has {n}; "
            "lower pp (or pp_stages_per_rank)"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(i: int, j: int, s: int) -> float:  # layers [i, j) as stage s
        c = prefix[j] - prefix[i]
        if s == 0:
            c += first_extra
        if s == num_stages - 1:
            c += last_extra
        return c

    inf = float("inf")
    # best[s][j]: minimal max cost of the first s+1 stages covering layers [0, j)
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    arg = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], cost(i, j, s))
                if v < best[s][j] - 1e-12 * max(1.0, abs(v)):
                    best[s][j], arg[s][j] = v, i
    bounds, j = [], n
    for s in range(num_stages - 1, 0, -1):
        i = arg[s][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return bounds[::-1]


def split_from_points(points: Sequence[Any], num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Layer ranges from the first layer index of each stage after the first
    (``distributed.pp_split_points``; ints or names like ``layers.4`` /
    ``backbone.layers.4``)."""
    idx = []
    for p in points:
        s = str(p).rsplit(".", 1)[-1] if not isinstance(p, int) else p
        try:
            idx.append(int(s))
        except ValueError:
            raise ValueError(
                f"distributed.pp_split_points: cannot read {p!r}; give layer indices "
                "(e.g. [4, 8]) or names like 'layers.4'"
            ) from None
    if len(idx) != num_stages - 1:
        raise ValueError(
            f"distributed.pp_split_points: {len(idx)} split points give {len(idx) + 1} stages, "
            f"but the layout has {num_stages} stages (pp × pp_stages_per_rank); give "
            f"{num_stages - 1} points"
        )
    if any(b <= a for a, b in zip([0] + idx, idx + [num_layers])):
        raise ValueError(
            f"distributed.pp_split_points: {idx} must be strictly increasing layer indices in "
            f"1..{num_layers - 1} (every stage needs at least one layer)"
        )
    starts = [0] + idx
    ends = idx + [num_layers]
    return list(zip(starts, ends))


def pipeline_layout(num_layers: int, dims, distributed, layer_costs: Sequence[float],
                    head_cost: float):
    """(schedule spec, number of stages, layer ranges of every stage, this rank's stage ids) for
    the ``distributed`` section: ``pp_schedule``, ``pp_stages_per_rank`` (None: 2 for
    interleaved / V schedules, else 1) and ``pp_split_points`` (None: balance ``layer_costs``,
    the last stage also paying ``head_cost``)."""
    spec = resolve_schedule(distributed.pp_schedule)
    stages_per_rank = distributed.pp_stages_per_rank
    if stages_per_rank is None:
        stages_per_rank = 2 if spec.multi else 1
    if spec.multi and stages_per_rank < 2:
        raise ValueError(
            f"distributed.pp_schedule={spec.name!r} interleaves several stages per rank; set "
            f"pp_stages_per_rank >= 2 (got {stages_per_rank})")
    if not spec.multi and stages_per_rank != 1:
        raise ValueError(
            f"distributed.pp_schedule={spec.name!r} runs one stage per rank; use an interleaved "
            f"schedule (interleaved1f1b, loopedbfs, interleavedzb, zbv) for "
            f"pp_stages_per_rank={stages_per_rank}")
    if spec.style == "v" and stages_per_rank != 2:
        raise ValueError(f"distributed.pp_schedule={spec.name!r} needs pp_stages_per_rank=2")
    num_stages = dims.pp * stages_per_rank
    if distributed.pp_split_points:
        ranges = split_from_points(distributed.pp_split_points, num_layers, num_stages)
    else:
        assert len(layer_costs) == num_layers, (len(layer_costs), num_layers)
        ranges = balanced_split(list(layer_costs), num_stages, first_extra=0.0,
                                last_extra=head_cost)
    stage_ids = stage_ids_for_rank(dims.local_rank("pp"), dims.pp, stages_per_rank, spec.style)
    return spec, num_stages, ranges, stage_ids


# -- batches ------------------------------------------------------------------------------------
def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Positions restarting at every segment start of ``cu_seqlens`` (flattened ``B·L``) and at
    every row start: the same document boundaries, in a form that splits by rows."""
    n = batch * length
    cu = cu_seqlens.to(torch.long).cpu()
    start = torch.zeros(n, dtype=torch.long)
    start[cu[:-1][cu[:-1] < n]] = 1
    start = start.view(batch, length)
    start[:, 0] = 1
    ar = torch.arange(length).expand(batch, length)
    last_start = torch.where(start.bool(), ar, torch.zeros_like(ar)).cummax(dim=1).values
    return (ar - last_start).to(cu_seqlens.device)


def _pad_right(t: torch.Tensor, length: int, value) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    pad = t.new_full((t.shape[0], length - t.shape[1]) + tuple(t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def _pad_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` zero-padded at the end of every dimension after the first to ``shape[1:]``."""
    pad = []
    for have, want in zip(reversed(t.shape[1:]), reversed(shape[1:])):
        pad += [0, want - have]
    return torch.nn.functional.pad(t, pad) if any(pad) else t


def merge_row_inputs(micro_batches: Sequence[dict], row_inputs) -> dict[str, torch.Tensor]:
    """``row_inputs(micro_batch)`` (tensors with one entry per row) of every micro-batch,
    zero-padded to common sizes and concatenated along the rows."""
    parts = [row_inputs(mb) for mb in micro_batches]
    out = {}
    for k in parts[0]:
        shape = [max(p[k].shape[d] for p in parts) for d in range(parts[0][k].dim())]
        out[k] = torch.cat([_pad_to(p[k], shape) for p in parts])
    return out


def merge_micro_batches(micro_batches: Sequence[dict], length: int | None = None,
                        row_inputs=None) -> dict:
    """One batch ``[sum B_i, L]`` with ``input_ids``, ``position_ids``, ``labels`` (and the
    first stage's extra inputs of ``row_inputs``, see :func:`merge_row_inputs`)."""
    rows = []
    for mb in micro_batches:
        ids = mb["input_ids"]
        B, L = ids.shape
        if mb.get("position_ids") is not None:
            pos = mb["position_ids"].expand(B, L)
        elif mb.get("cu_seqlens") is not None:
            pos = position_ids_from_cu_seqlens(mb["cu_seqlens"], B, L)
        else:
            pos = torch.arange(L, device=ids.device).expand(B, L)
        rows.append((ids, pos, mb["labels"]))
    L = max(r[0].shape[1] for r in rows) if length is None else length
    ids = torch.cat([_pad_right(r[0], L, 0) for r in rows])
    labels = torch.cat([_pad_right(r[2], L, IGNORE_INDEX) for r in rows])
    pos = []
    for _, p, _ in rows:
        if p.shape[1] < L:  # padding continues the row's last document
            extra = p[:, -1:] + torch.arange(1, L - p.shape[1] + 1, device=p.device)
            p = torch.cat([p, extra], dim=1)
        pos.append(p)
    extra = merge_row_inputs(micro_batches, row_inputs) if row_inputs is not None else {}
    return {"input_ids": ids, "position_ids": torch.cat(pos), "labels": labels, **extra}


class _AsVector(nn.Module):
    """The last stage's scalar CE sum as a 1-element vector (forward-only schedules merge the
    micro-batch outputs by concatenation)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs).reshape(1)


def _grads_in_param_layout(stages: Sequence[nn.Module]) -> None:
    """Give every plain gradient its parameter's strides. The zero-bubble schedules' weight pass
    sets gradients as autograd returns them (e.g. a Mamba conv weight's transposed), not in the
    parameter's layout as autograd's own accumulation does, and fused optimizers read a
    gradient by its parameter's strides (torch's fused CPU AdamW updates the wrong elements)."""
    for stage in stages:
        for p in stage.parameters():
            g = p.grad
            if g is not None and type(g) is torch.Tensor and g.stride() != p.stride():
                p.grad = torch.empty_strided(p.shape, p.stride(), dtype=g.dtype,
                                             device=g.device).copy_(g)


# -- the train step -----------------------------------------------------------------------------
class PipelineTrainStep:
    """Forward+backward of one global batch through the pipeline (see module docstring).

    ``stages``: this rank's stage modules, each ``forward(x, position_ids=, labels=)`` returning
    the hidden states ``[rows, L, hidden_size]`` in ``hidden_dtype`` (or, on the last stage, the
    fp32 CE *sum*); ``stage_ids``: their indices. ``row_inputs(micro_batch) -> {name: tensor}``:
    further keyword inputs of every stage (used by the first), each with one entry per row, so
    that the schedule splits them into micro-batches with the rows (a model spec's
    ``pipeline_row_inputs``, e.g. a row's images). ``shape_group``: the ranks that agree on
    the step's sequence length (the layout's ranks; None: all).
    The trainer's ``TrainStep(pipeline=...)`` calls it under its autocast context:
    ``__call__(model, micro_batches, num_label_tokens)`` returns the CE sum of this data-parallel
    rank's batch (on every pp rank), ``eval_loss(model, batch)`` is the forward-only CE sum for
    validation.
    """

    MAX_CACHED_SCHEDULES = 16

    def __init__(
        self,
        stages: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        pp_group,
        device: torch.device,
        hidden_size: int,
        hidden_dtype: torch.dtype,
        schedule: str = "1f1b",
        microbatch_size: int | None = None,
        pad_multiple: int = 1,
        shape_group=None,
        row_inputs=None,
    ):
        self.shape_group = shape_group  # the ranks that run one shape (None: all)
        self.spec = resolve_schedule(schedule)
        self.stages = list(stages)
        self.stage_ids = list(stage_ids)
        self.num_stages = num_stages
        self.pp_group = pp_group
        self.pp = dist.get_world_size(pp_group)
        self.device = torch.device(device)
        self.hidden_size = hidden_size
        self.hidden_dtype = hidden_dtype
        self.microbatch_size = microbatch_size
        self.pad_multiple = max(1, int(pad_multiple))
        self.row_inputs = row_inputs
        if self.spec.multi != (len(self.stages) > 1):
            raise ValueError(
                f"distributed.pp_schedule={self.spec.name!r} runs "
                f"{'several stages' if self.spec.multi else 'one stage'} per rank, but this rank "
                f"has {len(self.stages)}; set pp_stages_per_rank accordingly"
            )
        self._schedules: dict[tuple, Any] = {}
        self._num_label_tokens = 1.0
        self._ce_sums: list[torch.Tensor] = []

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self._ce_sums.append(output.detach().float().reshape(()))
        return output / self._num_label_tokens

    def _n_microbatches(self, batch_size: int, requested: int) -> int:
        if self.microbatch_size:
            if batch_size % self.microbatch_size:
                raise ValueError(
                    f"pipeline: the local batch of {batch_size} samples (micro_batch_size × "
                    f"gradient accumulation) is not divisible by distributed.pp_microbatch_size="
                    f"{self.microbatch_size}"
                )
            return batch_size // self.microbatch_size
        return requested

    def _stage_meta(self, sid: int, rows: int, length: int):
        """Static shapes of a stage's input and output (no run-time shape inference, which
        would run an extra forward/backward and leave gradients behind)."""
        meta = torch.device("meta")
        # activations carry gradients in both directions (requires_grad is part of the meta)
        hidden = torch.empty(rows, length, self.hidden_size, dtype=self.hidden_dtype,
                             device=meta).requires_grad_(True)
        if sid == 0:
            inp = torch.empty(rows, length, dtype=torch.long, device=meta)
        else:
            inp = hidden
        out = torch.empty((), dtype=torch.float32, device=meta) if sid == self.num_stages - 1 else hidden
        return inp, out

    def _schedule(self, n_micro: int, rows: int, length: int, train: bool):
        key = (n_micro, rows, length, train)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            stages = []
            for m, sid in zip(self.stages, self.stage_ids):
                inp, out = self._stage_meta(sid, rows, length)
                if not train:  # forward only: the last stage's CE sums are merged outputs
                    inp, out = inp.detach(), out.detach()
                    if sid == self.num_stages - 1:
                        m, out = _AsVector(m), out.reshape(1)
                stages.append(PipelineStage(m, sid, self.num_stages, self.device, input_args=inp,
                                            output_args=out, group=self.pp_group))
            sched = build_schedule(self.spec, stages, n_micro, self._loss if train else None)
            if len(self._schedules) >= self.MAX_CACHED_SCHEDULES:  # e.g. unpacked batches of
                self._schedules.pop(next(iter(self._schedules)))  # many lengths: drop the oldest
            self._schedules[key] = sched
        return self._schedules[key]

    def _global_length(self, length: int) -> int:
        """Every rank must run the same shapes (FSDP/EP collectives inside stages)."""
        m = self.pad_multiple
        length = -(-length // m) * m
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([length], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.shape_group)
            length = int(t)
        return length

    def _eval_rows(self, batch: dict) -> dict:
        """Validation batches may be small: add label-free rows until every stage gets work
        (at least ``num_stages`` micro-batches, a multiple of ``pp``)."""
        mbs = self.microbatch_size or 1
        n = -(-batch["input_ids"].shape[0] // mbs)
        need = max(n, self.num_stages)
        need = -(-need // self.pp) * self.pp
        extra = need * mbs - batch["input_ids"].shape[0]
        if extra <= 0:
            return batch
        out = {}
        for k, v in batch.items():
            fill = IGNORE_INDEX if k == "labels" else 0
            if k == "position_ids":
                pad = torch.arange(v.shape[1], device=v.device).expand(extra, -1)
            else:
                pad = v.new_full((extra,) + tuple(v.shape[1:]), fill)
            out[k] = torch.cat([v, pad])
        return out

    def _run(self, micro_batches: Sequence[dict], num_label_tokens: float, train: bool):
        length = self._global_length(max(mb["input_ids"].shape[1] for mb in micro_batches))
        batch = merge_micro_batches(micro_batches, length, self.row_inputs)
        if not train:
            batch = self._eval_rows(batch)
        n_rows = batch["input_ids"].shape[0]
        if train:
            n_micro = self._n_microbatches(n_rows, len(micro_batches))
        else:  # _eval_rows made the rows a multiple of the micro-batch size
            n_micro = n_rows // (self.microbatch_size or 1)
        if n_rows % n_micro:
            raise ValueError(
                f"pipeline: {n_rows} rows do not split into {n_micro} equal micro-batches; "
                "use equal micro-batch sizes (or set distributed.pp_microbatch_size)"
            )
        sched = self._schedule(n_micro, n_rows // n_micro, length, train)
        self._num_label_tokens = float(num_label_tokens)
        self._ce_sums = []
        first = 0 in self.stage_ids
        args = (batch["input_ids"],) if first else ()
        kwargs = {k: v for k, v in batch.items() if k != "input_ids"}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if not train and self.spec.style == "v":
            # the V schedules have no forward-only mode: walk the stages micro-batch by micro-batch
            total = total + self._forward_only(batch, n_micro, *args)
            dist.all_reduce(total, group=self.pp_group)
            return total
        if train:
            sched.step(*args, target=batch["labels"], return_outputs=False, **kwargs)
            if self.spec.split_backward:
                _grads_in_param_layout(self.stages)
            for s in self._ce_sums:
                total = total + s.to(self.device)
        else:
            out = sched.step(*args, **kwargs)
            if out is not None:  # the rank of the last stage: one CE sum per micro-batch
                total = total + out.float().sum().to(self.device)
        self._ce_sums = []
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank holds it
        return total

    def _forward_only(self, batch: dict, n_micro: int, *args) -> torch.Tensor:
        """This rank's CE sum (the last stage's) of :meth:`forward_outputs`."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for out in self.forward_outputs(batch, n_micro):
            total = total + out.float()
        return total

    def forward_outputs(self, batch: dict, n_micro: int) -> list[torch.Tensor]:
        """Forward-only pass without a schedule: micro-batch after micro-batch, every rank walks
        the stages in order, running its own and sending/receiving at rank boundaries (one
        global order, so no deadlock). Returns the last stage's output of every micro-batch on
        the rank that runs it, ``[]`` on the others."""
        me = dist.get_rank(self.pp_group)
        owner = [stage_rank(s, self.pp, self.spec.style) for s in range(self.num_stages)]
        module = dict(zip(self.stage_ids, self.stages))
        rows = batch["input_ids"].shape[0] // n_micro
        outputs = []
        for m in range(n_micro):
            sl = slice(m * rows, (m + 1) * rows)
            kwargs = {k: v[sl] for k, v in batch.items() if k != "input_ids"}
            x = None
            for s in range(self.num_stages):
                if owner[s] != me:
                    continue
                if s == 0:
                    x = batch["input_ids"][sl]
                elif owner[s - 1] != me:
                    x = torch.empty(rows, batch["input_ids"].shape[1], self.hidden_size,
                                    dtype=self.hidden_dtype, device=self.device)
                    dist.recv(x, group=self.pp_group, group_src=owner[s - 1])
                out = module[s](x, **kwargs)
                if s == self.num_stages - 1:
                    outputs.append(out)
                    continue
                x = out
                if owner[s + 1] != me:
                    dist.send(x.contiguous(), group=self.pp_group, group_dst=owner[s + 1])
        return outputs

    def __call__(self, model: nn.Module, micro_batches: Sequence[dict], num_label_tokens: int):
        return self._run(micro_batches, num_label_tokens, train=True)

    def eval_loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """Forward-only CE sum of one batch (validation); equal on every pp rank."""
        with torch.no_grad():
            return self._run([batch], 1.0, train=False)
