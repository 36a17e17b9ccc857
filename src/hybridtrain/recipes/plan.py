"""``hybridtrain plan``: print the memory plan of a recipe's layout
(:mod:`hybridtrain.training.memory_plan`) and, when it is over the headroom rule of
``--device-memory``, changes that lower it (each planned again).

    hybridtrain plan -c RECIPE.yaml --nproc-per-node 8 [--device-memory 80GB] [--json]

With ``--device-memory`` the plan applies the headroom rule
(:data:`~hybridtrain.training.memory_plan.HEADROOM`): a plan over it (or over the device) exits
with status 1 and lists the changes.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from typing import Any

from hybridtrain.config import build_config
from hybridtrain.config.sections import RecipeConfig, recipe_config
from hybridtrain.training.memory_plan import HEADROOM, GiB, MemoryPlan, plan_memory

__all__ = ["advise", "format_plan", "parse_memory", "run"]

# -- advice --------------------------------------------------------------------------------------
def _candidates(cfg: RecipeConfig, world_size: int, plan: MemoryPlan
                ) -> list[tuple[str, dict, int]]:
    """(what to change, recipe data with it, world size) to try when the plan does not fit."""
    base = cfg.node.to_dict()
    t, d = cfg.training, cfg.distributed
    out = []

    def with_(label, world=world_size, **sections):
        data = copy.deepcopy(base)
        for sec, values in sections.items():
            data[sec] = {**(data.get(sec) or {}), **values}
        out.append((label, data, world))

    if str(t.activation_checkpointing).lower() not in ("true", "all", "full"):
        with_("turn on activation checkpointing (--training.activation_checkpointing=true)",
              training={"activation_checkpointing": True})
    if t.micro_batch_size > 1:
        with_("lower micro_batch_size to 1 (--training.micro_batch_size=1)",
              training={"micro_batch_size": 1})
    if d.pp_microbatch_size and d.pp_microbatch_size > 1:
        with_("lower pp_microbatch_size to 1 (--distributed.pp_microbatch_size=1)",
              distributed={"pp_microbatch_size": 1})
    if plan.reshard_peaks and str(d.fsdp_reshard_after_forward) != "always":
        with_("reshard each FSDP2 unit after its forward and backward under the pipeline "
              "(--distributed.fsdp_reshard_after_forward=always; all-gathers again per "
              "micro-batch)", distributed={"fsdp_reshard_after_forward": "always"})
    powers = [2 ** i for i in range(world_size.bit_length()) if world_size % 2 ** i == 0]
    for pp in powers:  # other layouts of the same ranks (invalid ones are skipped)
        for ep in powers:
            if (pp, ep) != (d.pp, d.ep):
                with_(f"pp={pp}, ep={ep} (--distributed.pp={pp} --distributed.ep={ep})",
                      distributed={"pp": pp, "ep": ep, "dp_shard": -1})
    if plan.degrees["dp_shard"] * plan.degrees["cp"] * plan.degrees["dp_replicate"] > 1 \
            and not d.cpu_offload:
        with_("offload parameters, gradients and optimizer state to the host "
              "(--distributed.cpu_offload=true; slower)", distributed={"cpu_offload": True})
    if cfg.peft is None:
        extra = {"model": {"dtype": "bfloat16"}} if "dtype" in cfg.model else {}
        with_("use LoRA (a peft: section, e.g. dim 8, match_all_linear"
              + (", frozen base in bf16: model.dtype=bfloat16)" if extra else ")"),
              peft={"method": "lora", "dim": 8, "alpha": 32, "match_all_linear": True}, **extra)
    with_(f"use {2 * world_size} GPUs (FSDP shards over twice the ranks)", world=2 * world_size)
    return out


def advise(cfg: Any, world_size: int, plan: MemoryPlan, device_type: str
           ) -> list[dict]:
    """The candidate changes that lower the peak, each planned again, best first."""
    cfg = recipe_config(cfg)
    out, layouts = [], []
    for label, data, world in _candidates(cfg, world_size, plan):
        try:
            alt = plan_memory(build_config(data, source=str(cfg.source_file)), world,
                              device_type, plan.device_memory)
        except ValueError:  # the change does not fit this layout (divisibility, ...)
            continue
        if alt.peak < plan.peak * 0.995:
            entry = {"change": label, "peak": alt.peak, "fits": alt.fits,
                     "within_headroom": alt.within_headroom}
            (layouts if label.startswith("pp=") else out).append(entry)
    # of the other layouts, the best two
    return sorted(out + sorted(layouts, key=lambda a: a["peak"])[:2], key=lambda a: a["peak"])


# -- output --------------------------------------------------------------------------------------
def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def _ranks_label(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def format_plan(plan: MemoryPlan) -> str:
    deg = ", ".join(f"{k}={v}" for k, v in plan.degrees.items() if k != "world_size")
    lines = [
        f"hybridtrain plan: {plan.source} on {plan.world_size} ranks ({deg})",
        f"model {plan.model}: {plan.num_params / 1e9:.3f} B parameters "
        f"({plan.num_trainable / 1e9:.3f} B trainable) in {'/'.join(plan.param_dtypes)}; "
        f"compute {plan.compute_dtype}",
        f"micro-batch {plan.micro_batch} x {plan.seq_len} tokens; activation checkpointing: "
        f"{plan.activation_checkpointing}",
        "",
    ]
    roles = plan.roles()
    cats = sorted({k for r in plan.ranks for k in r.activations_per_micro_batch},
                  key=lambda k: (k in ("loss", "backward"), k))
    bufs = sorted({k for r in plan.ranks for k in r.buffers})
    rows: list[tuple[str, list[str]]] = [
        ("GiB per rank", [_ranks_label([r.rank for r in g]) for g in roles]),
        ("pipeline stages", [",".join(map(str, g[0].stages)) for g in roles]),
    ]
    if any(r.role for r in plan.ranks):  # distributed.encoder_ranks: which side a rank runs
        rows.insert(1, ("modules", [g[0].role for g in roles]))
    rows += [
        ("parameters", [_gib(g[0].params) for g in roles]),
        ("gradients", [_gib(g[0].grads) for g in roles]),
        ("optimizer state", [_gib(g[0].optimizer) for g in roles]),
        ("activations / micro-batch", [""] * len(roles)),
    ]
    rows += [(f"  {k}", [_gib(g[0].activations_per_micro_batch.get(k, 0.0)) for g in roles])
             for k in cats]
    rows += [("micro-batches in flight", [f"{g[0].micro_batches_in_flight:g}" for g in roles]),
             ("activations", [_gib(g[0].activations) for g in roles])]
    rows += [(k.replace("_", " "), [_gib(g[0].buffers.get(k, 0.0)) for g in roles]) for k in bufs]
    rows += [("total", [_gib(g[0].total) for g in roles])]
    if any(r.offloaded for r in plan.ranks):
        rows += [("on the host (cpu_offload)", [_gib(g[0].host) for g in roles])]
    w0 = max(len(r[0]) for r in rows) + 2
    w = max(10, *(len(v) + 2 for _, vals in rows for v in vals))
    lines += [f"{name:<{w0}}" + "".join(f"{v:>{w}}" for v in vals) for name, vals in rows]
    lines.append("")
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.reshard_peaks:
        lines.append("under pp, FSDP2's policy sets the peak (distributed.fsdp_reshard_after_forward): "
                     + "; ".join(f"{k}: {_gib(v)} GiB" for k, v in plan.reshard_peaks.items())
                     + " (default: each unit stays gathered through the step; always: gathered "
                     "again for each micro-batch)")
    peak = f"peak {_gib(plan.peak)} GiB"
    if plan.device_memory is None:
        lines.append(peak + " (give --device-memory to check it against a device)")
        return "\n".join(lines)
    lines.append(f"headroom rule: the peak may take {HEADROOM:.0%} of the device memory, "
                 f"{_gib(plan.limit)} of {_gib(plan.device_memory)} GiB; the rest is for what the "
                 "plan does not count (CUDA context, allocator fragmentation, NCCL buffers)")
    if plan.within_headroom:
        lines.append(f"{peak}: fits {_gib(plan.device_memory)} GiB per device within the "
                     f"headroom ({_gib(plan.device_memory - plan.peak)} GiB left)")
        return "\n".join(lines)
    if plan.fits:
        lines.append(f"{peak}: OVER THE HEADROOM: fits {_gib(plan.device_memory)} GiB per device "
                     f"with only {_gib(plan.device_memory - plan.peak)} GiB left, above the "
                     f"{_gib(plan.limit)} GiB the rule allows; what lowers it (each planned again):")
    else:
        lines.append(f"{peak}: does NOT fit {_gib(plan.device_memory)} GiB per device; what "
                     "lowers it (each planned again):")
    for a in plan.advice or [{"change": "nothing among pp, ep, checkpointing, micro-batch, "
                                        "LoRA and more GPUs lowers it", "peak": plan.peak,
                              "fits": False, "within_headroom": False}]:
        lines.append(f"  - {a['change']}: peak {_gib(a['peak'])} GiB"
                     + (" (within the headroom)" if a["within_headroom"]
                        else " (fits, over the headroom)" if a["fits"] else ""))
    return "\n".join(lines)


# device memory is quoted in binary units: an "80GB" H100 holds 80 GiB (nvidia-smi: 81559 MiB)
_UNITS = {"b": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


def parse_memory(text: str) -> float:
    """'80GB', '80GiB', '80G', '80' (all 80 * 2^30 bytes), '512MB' ... -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", str(text))
    unit = (m.group(2).lower() or ("b" if m.group(3) else "g")) if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"--device-memory: cannot read {text!r}; write e.g. 80GB or 79.5GiB")
    return float(m.group(1)) * _UNITS[unit]


def run(cfg: Any, world_size: int, device_memory: str | None = None, as_json: bool = False,
        device_type: str = "cuda") -> int:
    """Print the plan; 1 when it is over the headroom rule of ``device_memory`` (then with
    advice), else 0."""
    cfg = recipe_config(cfg)
    limit = parse_memory(device_memory) if device_memory else None
    plan = plan_memory(cfg, world_size, device_type, limit)
    if plan.within_headroom is False:
        plan.advice = advise(cfg, world_size, plan, device_type)
    sys.stdout.write((json.dumps(plan.to_dict(), indent=1) if as_json else format_plan(plan))
                     + "\n")
    return 1 if plan.within_headroom is False else 0
