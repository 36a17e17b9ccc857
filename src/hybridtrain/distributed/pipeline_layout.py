"""Pipeline layout arithmetic: which schedules exist, how layers split into stages, which
stages a rank holds and how many micro-batches a stage keeps in flight. Pure arithmetic over
torch's schedule classes: the run (:mod:`hybridtrain.distributed.pipeline`) and ``hybridtrain
plan`` both read it, no process group needed.

* **Schedules** (``distributed.pp_schedule``, case and ``_``/``-`` insensitive): ``1f1b``,
  ``gpipe``, ``interleaved1f1b``, ``loopedbfs``, ``interleavedzb``, ``zbv`` and ``dualpipev``.
  Single-stage schedules run one stage per rank; the multi-stage ones default to 2 stages per
  rank (``distributed.pp_stages_per_rank``). Stage ``s`` lives on rank ``s % pp`` ("loop"),
  except for the V schedules (``zbv``, ``dualpipev``), where rank ``r`` holds stages ``r`` and
  ``2·pp-1-r``.
* **Stage split**: contiguous layer ranges balancing a per-layer cost (the first stage also
  pays for the embeddings, the last for ``norm_f`` + the LM head), or a manual override
  (``distributed.pp_split_points``: the first layer of every stage after the first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "resolve_schedule",
    "build_schedule",
    "check_microbatches",
    "StagePosition",
    "micro_batches_in_flight",
    "stage_ids_for_rank",
    "stage_rank",
    "balanced_split",
    "split_from_points",
    "pipeline_layout",
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


def check_microbatches(spec: ScheduleSpec, num_stages: int, pp: int, n_microbatches: int) -> None:
    """ValueError (:func:`build_schedule`'s) when the schedule ``spec`` over ``num_stages``
    stages on ``pp`` ranks does not take ``n_microbatches`` per step; builds no stage."""
    stages = [StagePosition(s, num_stages, 0, pp)
              for s in stage_ids_for_rank(0, pp, num_stages // pp, spec.style)]
    build_schedule(spec, stages, n_microbatches, loss_fn=_no_loss)


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
