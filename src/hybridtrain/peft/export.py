"""LoRA adapters in the Hugging Face PEFT format, and merged checkpoints.

An adapter directory holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` with PEFT's key names, under Hub module
names::

    base_model.model.backbone.layers.{i}.mixer.q_proj.lora_A.weight          [r, in]
    base_model.model.backbone.layers.{i}.mixer.q_proj.lora_B.weight          [out, r]
    base_model.model.backbone.layers.{i}.mixer.experts.{j}.up_proj.lora_A.weight   (one per expert)

``target_modules`` is the list of adapted leaf names (``["in_proj", "q_proj", ...]``) when every
module with those names is adapted, otherwise a regular expression (PEFT full-matches it against
module names) that names exactly the adapted modules.

Loading accepts these files and adapters PEFT wrote for the transformers implementation of the
model (whose module names the spec's ``peft_module_prefixes`` map to ours).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from hybridtrain.distributed.activation_checkpoint import state_dict_name
from hybridtrain.distributed.utils import barrier, get_rank, get_world_size
from hybridtrain.fileio import (apply_umask, open_safetensors, read_json)
from hybridtrain.models.spec import PeftSupport, get_model_spec, model_spec_for

from hybridtrain.distributed.full_tensors import global_layout, stream_full_tensors
from .quant import base_quant_of, dense, dense_shapes
from .lora import (
    EXCLUDED_LINEARS, LoRAExperts, adapter_pairs, num_experts, apply_lora, expert_types, has_lora,
    load_lora_state_dict, lora_modules, lora_settings, merge_lora, merge_weight,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_config",
    "peft_state_dict",
    "save_peft_adapter",
    "export_peft",
    "load_peft_adapter",
    "save_merged_hf",
    "merge_adapter_into_hf",
]

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_QUANT_FILE = "base_quant.json"  # QLoRA: the quantisation of the base the adapter was trained on
PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_HUB_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(up_proj|down_proj)$")
# tokenizer / generation files copied next to a merged checkpoint
_SIDE_FILES = re.compile(r"^(tokenizer.*|special_tokens_map\.json|generation_config\.json|chat_template\.jinja|"
                         r"vocab\.json|merges\.txt)$")


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective), as a CPU tensor."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu()


# ---------------------------------------------------------------------------------- naming
def _hub_modules(model: nn.Module) -> list[str]:
    """Hub names of every module LoRA could adapt (experts one per expert)."""
    out = []
    for name, mod in model.named_modules():
        name = state_dict_name(name)
        if isinstance(mod, expert_types(model)):
            out += [f"{name}.{j}.{p}" for p in ("up_proj", "down_proj") for j in range(num_experts(mod))]
        elif isinstance(mod, nn.Linear) and name.split(".")[-1] not in EXCLUDED_LINEARS:
            out.append(name)
    return out


def _adapted_hub_modules(model: nn.Module) -> list[str]:
    out = []
    for name, mod in lora_modules(model):
        if isinstance(mod, LoRAExperts):
            out += [f"{name}.{j}.{p}" for p in mod.lora_projs for j in range(mod.num_experts)]
        else:
            out.append(name)
    return out


def _target_modules(adapted: list[str], candidates: list[str],
                    stack_prefixes: tuple[str, ...] = ()) -> list[str] | str:
    """PEFT ``target_modules`` naming exactly the ``adapted`` Hub module names."""
    leaves = {n.rsplit(".", 1)[-1] for n in adapted}
    if {n for n in candidates if n.rsplit(".", 1)[-1] in leaves} == set(adapted):
        return sorted(leaves)
    # exact set; names relative to the decoder stack (``stack_prefixes``: the spec's prefixes of
    # it, ours and the transformers implementation's) so that either implementation's match
    rel = []
    for n in adapted:
        n = next((n[len(p):] for p in stack_prefixes if n.startswith(p)), n)
        e = _HUB_EXPERT.match(n)
        rel.append(re.escape(e.group(1)) + r"\.\d+\." + e.group(3) if e else re.escape(n))
    return r"(?:.*\.)?(?:" + "|".join(dict.fromkeys(rel)) + r")"


def _adapter_meta(model: nn.Module) -> dict:
    """What the adapter config needs from this rank's part of the model."""
    return {"settings": lora_settings(model) if has_lora(model) else None,
            "adapted": _adapted_hub_modules(model), "candidates": _hub_modules(model),
            "stack_prefixes": _stack_prefixes(model), "base_quant": base_quant_of(model)}


def _peft_part(model: nn.Module) -> PeftSupport:
    """The model spec's PEFT part (an empty one for a model without: no experts, no notes)."""
    try:
        return model_spec_for(model).find(PeftSupport) or PeftSupport()
    except ValueError:  # not a registered model (a test stand-in)
        return PeftSupport()


def _stack_prefixes(model: nn.Module) -> tuple[str, ...]:
    prefixes = _peft_part(model).module_prefixes
    return tuple(dict.fromkeys([*prefixes, *prefixes.values()]))


def _combine_meta(metas: list[dict]) -> dict:
    """Union over ranks (pipeline stages hold different layers; other ranks repeat them)."""
    settings = [m["settings"] for m in metas if m["settings"] is not None]
    if not settings:
        raise ValueError("the model has no LoRA adapters to export (call apply_lora first)")
    s = {k: settings[0][k] for k in ("dim", "alpha", "dropout")}
    assert all({k: o[k] for k in s} == s for o in settings), settings
    return {"settings": s, "adapted": list(dict.fromkeys(n for m in metas for n in m["adapted"])),
            "candidates": list(dict.fromkeys(n for m in metas for n in m["candidates"])),
            "stack_prefixes": metas[0]["stack_prefixes"],
            "base_quant": next((m["base_quant"] for m in metas if m.get("base_quant")), None)}


def adapter_config(model: nn.Module, base_model_name_or_path: str | None = None, meta: dict | None = None) -> dict:
    """The PEFT ``LoraConfig`` dict of the model's adapters (``meta``: the union over ranks)."""
    meta = meta or _combine_meta([_adapter_meta(model)])
    s = meta["settings"]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "revision": None,
        "r": s["dim"],
        "lora_alpha": s["alpha"],
        "lora_dropout": s["dropout"],
        "target_modules": _target_modules(meta["adapted"], meta["candidates"], meta["stack_prefixes"]),
        "exclude_modules": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "auto_mapping": None,
    }


def peft_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT key names (full CPU tensors; collective under FSDP/EP)."""
    out: dict[str, torch.Tensor] = {}
    to_hub = _hub_layout(model, to_hub=True)
    for name, mod in lora_modules(model):
        if isinstance(mod, LoRAExperts):
            for p in mod.lora_projs:
                A, B = _full(getattr(mod, f"{p}_lora_A")), _full(getattr(mod, f"{p}_lora_B"))
                for j in range(A.shape[0]):
                    out[f"{PEFT_PREFIX}{name}.{j}.{p}.lora_A.weight"] = A[j].clone()
                    out[f"{PEFT_PREFIX}{name}.{j}.{p}.lora_B.weight"] = B[j].clone()
        else:
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = to_hub(f"{name}.lora_A", _full(mod.lora_A)).contiguous()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = to_hub(f"{name}.lora_B", _full(mod.lora_B)).contiguous()
    return out


def _hub_layout(model: nn.Module, to_hub: bool):
    """``(our name, tensor) -> tensor`` in the Hugging Face layout (``to_hub``) or back (the
    spec's ``hub_layout``; the identity for a model without one)."""
    try:
        fn = model_spec_for(model).hf.hub_layout
    except ValueError:  # not a registered model (a test stand-in)
        fn = None
    if fn is None:
        return lambda name, t: t
    return lambda name, t: fn(name, t, model.config, to_hub)


# ---------------------------------------------------------------------------------- saving
def _write_dir(out_dir: str, write) -> None:
    """Write into a temporary sibling, then move the files into ``out_dir``."""
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=os.path.dirname(out_dir))
    try:
        write(tmp)
        os.makedirs(out_dir, exist_ok=True)
        apply_umask(tmp)  # safetensors writes 0600
        for fn in sorted(os.listdir(tmp), key=lambda f: f == ADAPTER_CONFIG):  # config last
            os.replace(os.path.join(tmp, fn), os.path.join(out_dir, fn))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_peft_adapter(model: nn.Module, out_dir: str | os.PathLike,
                      base_model_name_or_path: str | None = None,
                      tensors: Mapping[str, torch.Tensor] | None = None, meta: dict | None = None) -> str:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (single process; see
    :func:`export_peft` under torch.distributed). Returns the directory."""
    meta = meta or _combine_meta([_adapter_meta(model)])
    cfg = adapter_config(model, base_model_name_or_path, meta)
    tensors = dict(peft_state_dict(model) if tensors is None else tensors)

    def write(tmp):
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        if meta.get("base_quant"):  # beside PEFT's files (PEFT ignores it): merge reads it
            with open(os.path.join(tmp, BASE_QUANT_FILE), "w") as f:
                json.dump({"base_quant": meta["base_quant"]}, f)

    _write_dir(os.fspath(out_dir), write)
    _note_peft_compat(model, meta["adapted"])
    return os.path.abspath(out_dir)


_NOTED = False


def _note_peft_compat(model: nn.Module, adapted: list[str]) -> None:
    """Say once what PEFT's ``PeftModel`` on the transformers model cannot take (the spec's)."""
    global _NOTED
    notes = _peft_part(model).export_notes
    note = notes(adapted) if notes is not None else None
    if note and not _NOTED:
        _NOTED = True
        logger.info("%s", note)


def _gather_to_rank0(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every key once on rank 0, sent by the lowest rank that holds it (pipeline stages hold
    different keys; data-parallel replicas the same ones)."""
    world = get_world_size()
    keys: list = [None] * world
    dist.all_gather_object(keys, sorted(tensors))
    owner: dict[str, int] = {}
    for r, ks in enumerate(keys):
        for k in ks:
            owner.setdefault(k, r)
    mine = {k: t for k, t in tensors.items() if owner[k] == get_rank()}
    parts: list | None = [None] * world if get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {k: t for p in parts for k, t in p.items()} if parts is not None else {}


def export_peft(model: nn.Module, out_dir: str | os.PathLike, base_model_name_or_path: str | None = None,
                tokenizer=None) -> str:
    """PEFT export of a LoRA model, also sharded (FSDP2 / EP) or split into pipeline stages;
    collective: call on every rank, rank 0 writes. ``tokenizer`` (with ``save_pretrained``) is
    saved alongside when given."""
    tensors = peft_state_dict(model)  # gathers DTensors on every rank
    meta = _adapter_meta(model)
    if get_world_size() > 1:
        metas: list = [None] * get_world_size()
        dist.all_gather_object(metas, meta)
        tensors = _gather_to_rank0(tensors)
    else:
        metas = [meta]
    if get_rank() == 0:
        save_peft_adapter(model, out_dir, base_model_name_or_path, tensors=tensors, meta=_combine_meta(metas))
        if tokenizer is not None:
            tokenizer.save_pretrained(os.fspath(out_dir))
    barrier()
    return os.path.abspath(out_dir)


def save_merged_hf(model: nn.Module, out_dir: str | os.PathLike, tokenizer=None,
                   max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None) -> str:
    """A plain Hugging Face checkpoint with the adapters folded in; the model keeps its adapters.
    ``dtype``: the dtype to write (``checkpoint.save_dtype``, as for ``hf/``; None: as held).
    Collective under torch.distributed: each weight (and its adapters) is gathered in turn to
    rank 0, which folds and writes it, holding at most one output file's tensors (FSDP, expert
    slices and pipeline stages alike)."""
    spec = model_spec_for(model)
    layout = global_layout(model)
    shapes = dense_shapes(model)  # a QLoRA base: written dequantised
    pairs = adapter_pairs(list(layout))
    metas = [_adapter_meta(model)]
    if get_world_size() > 1:
        metas = [None] * get_world_size()
        dist.all_gather_object(metas, _adapter_meta(model))
    settings = _combine_meta(metas)["settings"]
    scale = settings["alpha"] / settings["dim"]
    adapters = {n for ab in pairs.values() for n in ab}

    def unpacked(n):
        return (lambda t: dense(t, shapes[n])) if n in shapes else (lambda t: t)

    items = [(n, (n, *pairs[n]), lambda w, a, b, u=unpacked(n): merge_weight(u(w), a, b, scale))
             if n in pairs else (n, (n,), unpacked(n)) for n in layout if n not in adapters]
    stream = stream_full_tensors(model, layout, items)
    if get_rank() == 0:
        plain = {n: layout[n].new_empty(shapes[n]) if n in shapes else layout[n]
                 for n, _, _ in items}
        spec.hf.save(plain, model.config, out_dir, max_shard_size=max_shard_size, dtype=dtype,
                     tensors=stream)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.fspath(out_dir))
    for _ in stream:  # the other ranks' part (and the end of rank 0's)
        pass
    barrier()
    return os.path.abspath(out_dir)


# ---------------------------------------------------------------------------------- loading
def _read_adapter(adapter_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg_path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    w_path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(cfg_path) or not os.path.isfile(w_path):
        extra = " (adapter_model.bin is not supported: convert it to safetensors)" \
            if os.path.isfile(os.path.join(adapter_dir, "adapter_model.bin")) else ""
        raise ValueError(f"{adapter_dir}: not a PEFT adapter directory; expected {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS}{extra}")
    cfg = read_json(cfg_path)
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{cfg_path}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are supported")
    unsupported = {
        "use_dora": cfg.get("use_dora"), "use_rslora": cfg.get("use_rslora"),
        "fan_in_fan_out": cfg.get("fan_in_fan_out"), "rank_pattern": cfg.get("rank_pattern"),
        "alpha_pattern": cfg.get("alpha_pattern"), "modules_to_save": cfg.get("modules_to_save"),
        "lora_bias": cfg.get("lora_bias"), "target_parameters": cfg.get("target_parameters"),
    }
    bad = {k: v for k, v in unsupported.items() if v}
    if cfg.get("bias", "none") != "none":
        bad["bias"] = cfg["bias"]
    if bad:
        raise ValueError(f"{cfg_path}: unsupported LoRA options {bad}; hybridtrain loads plain LoRA "
                         "(bias none, no DoRA/rsLoRA/rank or alpha patterns/modules_to_save)")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)):
            raise ValueError(f"{cfg_path}: missing or invalid {key!r}")
    with open_safetensors(w_path) as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return cfg, tensors


def _to_ours(tensors: Mapping[str, torch.Tensor], model: nn.Module, where: str):
    """PEFT keys -> (our LoRA state dict, adapted names)."""
    linear: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    to_ours = _hub_layout(model, to_hub=False)
    for key, t in tensors.items():
        m = _KEY.match(key)
        if not m:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight "
                             "(expected '<module>.lora_A.weight' / '<module>.lora_B.weight')")
        mod, ab = m.group(1), m.group(2)
        for theirs, ours in _peft_part(model).module_prefixes.items():
            if mod.startswith(theirs) and not mod.startswith(ours):  # another implementation's names
                mod = ours + mod[len(theirs):]
        e = _HUB_EXPERT.match(mod)
        if e:
            experts.setdefault((e.group(1), e.group(3), ab), {})[int(e.group(2))] = t
        else:
            linear[f"{mod}.lora_{ab}"] = to_ours(f"{mod}.lora_{ab}", t)
    sd = dict(linear)
    names = sorted({k.rsplit(".", 1)[0] for k in linear})
    for (mod, proj, ab), per in sorted(experts.items()):
        try:
            sub = model.get_submodule(mod)
            n = num_experts(sub)
        except AttributeError:
            raise ValueError(f"{where}: adapter for {mod}.*.{proj}, but the model has no experts module {mod}") \
                from None
        if sorted(per) != list(range(n)):
            raise ValueError(f"{where}: {mod}.*.{proj}.lora_{ab}: the adapter has experts {sorted(per)[:8]}..., "
                             f"the model has {n}; every expert needs its adapter")
        sd[f"{mod}.{proj}_lora_{ab}"] = torch.stack([per[j] for j in range(n)])
        names.append(f"{mod}.{proj}")
    return sd, sorted(set(names))


def load_peft_adapter(model: nn.Module, adapter_dir: str | os.PathLike,
                      base_quant: str | None = None) -> list[str]:
    """Load a PEFT LoRA adapter into ``model``: adds the adapters (if the model has none yet;
    their dtype is the file's; ``base_quant``: the base under them quantised, as
    ``peft.base_quant``) and copies the weights. Returns the adapted names."""
    adapter_dir = os.fspath(adapter_dir)
    cfg, tensors = _read_adapter(adapter_dir)
    where = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    sd, names = _to_ours(tensors, model, where)
    if not sd:
        raise ValueError(f"{where} holds no tensors")
    r, alpha, dropout = int(cfg["r"]), cfg["lora_alpha"], float(cfg.get("lora_dropout") or 0.0)
    if has_lora(model):
        s = lora_settings(model)
        if (s["dim"], s["alpha"], sorted(s["targets"])) != (r, alpha, names):
            raise ValueError(f"{adapter_dir}: adapter (r={r}, alpha={alpha}, {len(names)} targets) does not "
                             f"match the model's adapters (r={s['dim']}, alpha={s['alpha']}, "
                             f"{len(s['targets'])} targets)")
    else:
        dtype = next(iter(tensors.values())).dtype
        try:
            apply_lora(model, dim=r, alpha=alpha, dropout=dropout, target_modules=names, dtype=dtype,
                       base_quant=base_quant)
        except ValueError as e:
            raise ValueError(f"{where}: the adapter's modules do not fit this model: {e}") from None
    try:
        load_lora_state_dict(model, sd)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return names


def adapter_base_quant(adapter_dir: str | os.PathLike) -> str | None:
    """The ``peft.base_quant`` an adapter was trained on (its ``base_quant.json``), or None."""
    path = os.path.join(os.fspath(adapter_dir), BASE_QUANT_FILE)
    return read_json(path)["base_quant"] if os.path.isfile(path) else None


def _model_class(hf_dir: str) -> type[nn.Module]:
    """The model class of a Hugging Face folder: the spec named by its config's ``model_type``."""
    path = os.path.join(hf_dir, "config.json")
    try:
        model_type = read_json(path)["model_type"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: cannot read the model_type of the base model ({e})") from None
    return get_model_spec(model_type).model_cls


def _same_base(recorded: str, base_dir: str, adapter_dir: str) -> bool:
    """Whether ``base_dir`` is the base ``recorded`` in an adapter's config: the same folder
    when ``recorded`` is a path that exists (relative paths: to the current folder or the
    adapter's), else a Hub id ``org/name`` (or a path from another machine) whose last two
    parts ``base_dir`` ends with, or a Hub cache ``models--org--name/snapshots/<rev>``."""
    for root in (os.getcwd(), adapter_dir):
        path = os.path.join(root, os.path.expanduser(recorded))
        if os.path.isdir(path):
            return os.path.realpath(path) == os.path.realpath(base_dir)
    parts = [p for p in recorded.strip("/").split("/") if p][-2:]
    real = os.path.realpath(base_dir).split(os.sep)
    if real[-len(parts):] == parts:
        return True
    cache = "models--" + "--".join(parts)
    return len(real) >= 3 and real[-3] == cache and real[-2] == "snapshots"


def merge_adapter_into_hf(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike,
                          out_dir: str | os.PathLike, dtype: torch.dtype | str | None = None,
                          max_shard_size: int | str = "5GB",
                          allow_base_mismatch: bool = False) -> str:
    """Base HF checkpoint + PEFT adapter -> merged plain HF checkpoint (plus the base's tokenizer
    and generation files). Returns the output directory.

    The adapter must have been trained on ``base_dir``: a different ``base_model_name_or_path``
    in its ``adapter_config.json`` is a ``ValueError`` naming both, unless
    ``allow_base_mismatch`` (same shapes are no proof of the same weights)."""
    base_dir, adapter_dir, out_dir = (os.path.abspath(os.fspath(d)) for d in (base_dir, adapter_dir, out_dir))
    if out_dir in (base_dir, adapter_dir):
        raise ValueError(f"--out {out_dir} must differ from --base and --adapter")
    cfg, _ = _read_adapter(adapter_dir)  # fail on a bad adapter before loading a large base model
    recorded = cfg.get("base_model_name_or_path")
    if recorded and not _same_base(str(recorded), base_dir, adapter_dir):
        if not allow_base_mismatch:
            raise ValueError(
                f"{os.path.join(adapter_dir, ADAPTER_CONFIG)} was trained on base "
                f"'{recorded}', not on --base {base_dir}; merging it into another model gives "
                "wrong weights even when the shapes fit. Pass the adapter's base, or "
                "--allow-base-mismatch if you know they hold the same weights")
        logger.warning("merging an adapter trained on %s into %s (--allow-base-mismatch)",
                       recorded, base_dir)
    elif not recorded:
        logger.warning("%s records no base_model_name_or_path: cannot check that %s is its base",
                       os.path.join(adapter_dir, ADAPTER_CONFIG), base_dir)
    model = _model_class(base_dir).from_pretrained(base_dir, dtype=dtype)
    quant = adapter_base_quant(adapter_dir)
    names = load_peft_adapter(model, adapter_dir, base_quant=quant)
    if quant:
        logger.info("%s was trained on a %s base: the base is quantised and dequantised again "
                    "before the adapters are folded in", adapter_dir, quant)
    merge_lora(model)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    for src in (base_dir, adapter_dir):  # adapter's tokenizer files win
        for fn in os.listdir(src):
            if _SIDE_FILES.match(fn) and os.path.isfile(os.path.join(src, fn)):
                shutil.copyfile(os.path.join(src, fn), os.path.join(out_dir, fn))
    logger.info("merged %d adapted modules from %s into %s -> %s", len(names), adapter_dir, base_dir, out_dir)
    return out_dir
