"""Reading and writing Hugging Face Nemotron-H checkpoints (safetensors, Hub parameter names).

Our parameter names are the Hub's except for the MoE experts, which we hold stacked:
``backbone.layers.{i}.mixer.experts.up_proj [E, I, H]`` <->
``backbone.layers.{i}.mixer.experts.{j}.up_proj.weight [I, H]`` (same for ``down_proj``).
The Mamba ``in_proj`` / ``conv1d`` rows are held group by group (see ``mamba2``):
:func:`hub_layout` reorders them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file
from torch import nn

from hybridtrain.config.dtypes import dtype_name, to_torch_dtype
from hybridtrain.fileio import apply_umask, open_safetensors, read_json

from hybridtrain.distributed.materialize import SafetensorsReader
from .config import NemotronHConfig
from .mamba2 import group_major_rows

# the model class (model.py imports this module, never the other way round)
ModelT = TypeVar("ModelT", bound=nn.Module)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# multi-token prediction tensors: built when config.json asks for MTP layers
# (`num_nextn_predict_layers`), else skipped on load as transformers does
IGNORED_ON_LOAD = re.compile(r"^mtp\.")
_EXPERT_HUB = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
_EXPERT_OURS = re.compile(r"^(.*\.mixer\.experts)\.(up_proj|down_proj)$")
# tensors whose rows follow the Mamba in_proj output / conv1d channels (a LoRA B included)
_MAMBA_ROWS = re.compile(r"\.mixer\.(in_proj|conv1d)\.(weight|bias|lora_B)$")

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
# parameters kept in fp32 whatever the model dtype (as transformers' _keep_in_fp32_modules_strict)
_KEEP_FP32 = ("e_score_correction_bias",)


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model built from its config.json."""


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """None / ``"auto"`` -> None (as stored); a dtype or a dtype name -> the dtype."""
    return None if dtype is None or dtype == "auto" else to_torch_dtype(dtype)


def parse_size(size: int | str) -> int:
    """Bytes from 5000000, "5GB" (10^9) or "5GiB" (2^30), as transformers' max_shard_size."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a string like '5GB', '500MB', '2GiB'")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return max(1, int(float(m.group(1)) * mult))


# ---------------------------------------------------------------------------------- name mapping
def hub_name_to_ours(name: str) -> tuple[str, int | None]:
    """Hub tensor name -> (our parameter/buffer name, expert index or None)."""
    m = _EXPERT_HUB.match(name)
    if m:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    return name, None


def hub_layout(name: str, t: torch.Tensor, config: NemotronHConfig, to_hub: bool) -> torch.Tensor:
    """``t`` (our tensor ``name``) with its rows in the Hub's order (``to_hub``), or a Hub
    tensor's rows in ours: the Mamba ``in_proj`` / ``conv1d`` rows (and an in_proj LoRA B) are
    group-major here, ``[z | x | B | C | dt]`` on the Hub; every other tensor as it is."""
    m = _MAMBA_ROWS.search(name)
    if m is None or config.n_groups == 1:
        return t
    rows = group_major_rows(config, conv=m.group(1) == "conv1d").to(t.device)
    if not to_hub:
        return t.index_select(0, rows)
    return t.index_select(0, torch.argsort(rows))


def hub_tensors(state_dict: Mapping[str, torch.Tensor], config: NemotronHConfig | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Our state dict -> (Hub name, tensor) pairs, experts unstacked (views, no copies); with
    ``config``, rows in the Hub's order (:func:`hub_layout`; shapes are the same either way)."""
    for name, t in state_dict.items():
        m = _EXPERT_OURS.match(name)
        if m:
            for j in range(t.shape[0]):
                yield f"{m.group(1)}.{j}.{m.group(2)}.weight", t[j]
        else:
            yield name, t if config is None else hub_layout(name, t, config, to_hub=True)


def hub_slice(name: str, region: tuple[slice, ...],
              read: Callable[[str, tuple[slice, ...]], torch.Tensor],
              config: NemotronHConfig | None = None,
              reordered: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """``region`` of our tensor ``name`` assembled from Hub tensors, ``read(hub_name, region)``
    reading a region of one Hub tensor: a stacked experts slice reads only its experts' tensors,
    one at a time. Tensors whose rows are ordered differently here (:func:`hub_layout`, given
    ``config``) are read whole, reordered, then cut: one Hub tensor at a time, the last one
    kept in ``reordered`` (when given) for the next regions of the same tensor."""
    m = _EXPERT_OURS.match(name)
    if m:
        first, stop = region[0].start, region[0].stop
        return torch.stack([read(f"{m.group(1)}.{j}.{m.group(2)}.weight", region[1:])
                            for j in range(first, stop)])
    if config is not None and config.n_groups > 1 and _MAMBA_ROWS.search(name):
        if reordered is None or name not in reordered:
            if reordered is not None:
                reordered.clear()
            whole = hub_layout(name, read(name, (slice(None),)), config, to_hub=False)
            if reordered is None:
                return whole[region]
            reordered[name] = whole
        return reordered[name][region]
    return read(name, region)


def slice_reader(local_dir: str | os.PathLike, config_cls: type = NemotronHConfig,
                 layout_config: Callable[[Any], NemotronHConfig] = lambda config: config,
                 rename: Callable[[str], str] = lambda name: name,
                 ) -> Callable[[str, tuple[slice, ...]], torch.Tensor]:
    """``read(name, region)``: a region of our tensor ``name`` read from the checkpoint in
    ``local_dir`` (only the bytes it needs; see :func:`hub_slice`: a tensor read whole to be
    reordered is kept for the next regions of it, e.g. QLoRA's row chunks; ``config_cls`` /
    ``layout_config`` / ``rename`` as :func:`load_pretrained`'s)."""
    reader = SafetensorsReader(checkpoint_files(local_dir))
    config = layout_config(config_cls.from_pretrained(local_dir))
    reordered: dict[str, torch.Tensor] = {}
    return lambda name, region: hub_slice(name, region, lambda n, r: reader.read(rename(n), r),
                                          config, reordered)


def expected_hub_shapes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in hub_tensors(state_dict)}


# ---------------------------------------------------------------------------------- loading
def checkpoint_files(local_dir: str | os.PathLike) -> list[str]:
    """The safetensors files of a local checkpoint directory (index json or single file)."""
    local_dir = os.fspath(local_dir)
    index = os.path.join(local_dir, INDEX_FILE)
    single = os.path.join(local_dir, SINGLE_FILE)
    if os.path.isfile(index):
        index_json = read_json(index)
        if not isinstance(index_json, dict) or not isinstance(index_json.get("weight_map"), dict):
            raise ValueError(f"{index}: not a safetensors index (no 'weight_map' object); copy "
                             "or download it again")
        weight_map = index_json["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(local_dir, fn))]
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {missing}")
        return [os.path.join(local_dir, fn) for fn in files]
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(os.path.join(local_dir, "pytorch_model.bin")) or os.path.isfile(
        os.path.join(local_dir, "pytorch_model.bin.index.json")
    ):
        raise ValueError(f"{local_dir}: only safetensors checkpoints are supported (found pytorch_model.bin)")
    raise ValueError(f"{local_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


def read_checkpoint_header(files: list[str]) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """Hub name -> (shape, safetensors dtype, file), without reading any tensor data."""
    found: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for path in files:
        with open_safetensors(path) as f:
            for k in f.keys():
                sl = f.get_slice(k)
                if k in found:
                    raise ValueError(f"tensor {k} appears in both {found[k][2]} and {path}")
                found[k] = (tuple(sl.get_shape()), sl.get_dtype(), path)
    return found


def check_tensors(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[tuple[int, ...], str, str]],
    where: str,
) -> None:
    """Raise :class:`CheckpointMismatchError` naming every missing, unexpected or mis-shaped tensor."""
    missing = sorted(n for n in expected if n not in found)
    unexpected = sorted(n for n in found if n not in expected and not IGNORED_ON_LOAD.match(n))
    bad_shape = sorted(
        (n, expected[n], found[n][0]) for n in expected if n in found and tuple(found[n][0]) != tuple(expected[n])
    )
    if not (missing or unexpected or bad_shape):
        return
    lines = [f"checkpoint {where} does not match the model described by its config.json:"]
    if missing:
        lines.append(f"  missing tensors ({len(missing)}): " + ", ".join(missing))
    if unexpected:
        lines.append(f"  unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected))
    for n, exp, got in bad_shape:
        lines.append(f"  wrong shape: {n}: checkpoint has {list(got)}, model expects {list(exp)}")
    if missing and all(n.startswith("mtp.") for n in missing) and not any(n.startswith("mtp.") for n in found):
        lines.append("  config.json declares multi-token prediction layers (num_nextn_predict_layers) but "
                     "the checkpoint holds no mtp.* tensor (transformers and most trainers drop them when "
                     "saving): load the original checkpoint's MTP layers, or set num_nextn_predict_layers "
                     "to 0 in config.json to use the model without them")
    raise CheckpointMismatchError("\n".join(lines))


def load_pretrained(
    cls: type[ModelT],
    local_dir: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    config_cls: type = NemotronHConfig,
    layout_config: Callable[[Any], NemotronHConfig] = lambda config: config,
    rename: Callable[[str], str] = lambda name: name,
) -> ModelT:
    """``cls(config_cls.from_pretrained(local_dir))`` filled from the checkpoint tensor by tensor
    (``layout_config(config)``: the Nemotron-H config whose Mamba rows :func:`hub_layout`
    reorders; a model holding a Nemotron-H inside gives its language config; ``rename``: a
    Hub name -> the checkpoint's, for a layout that names some tensors otherwise)."""
    local_dir = os.fspath(local_dir)
    if not os.path.isdir(local_dir):
        raise ValueError(f"{local_dir}: not a directory (from_pretrained takes a local checkpoint directory)")
    config = config_cls.from_pretrained(local_dir)
    files = checkpoint_files(local_dir)
    found = read_checkpoint_header(files)

    with torch.device("meta"):
        model = cls(config)
    state = model.state_dict(keep_vars=True)
    shapes = expected_hub_shapes(state)
    check_tensors({rename(n): shape for n, shape in shapes.items()}, found, local_dir)
    hub = {rename(n): n for n in shapes}  # the checkpoint's name -> the Hub's

    # as stored: the most common floating dtype of the checkpoint
    counts = Counter(found[n][1] for n in found if not IGNORED_ON_LOAD.match(n) and found[n][1] in _ST_DTYPES)
    stored = _ST_DTYPES[counts.most_common(1)[0][0]] if counts else torch.float32
    dtype = parse_dtype(dtype) or stored
    device = torch.device(device) if device is not None else torch.device("cpu")
    model.to(dtype=dtype)  # (the router keeps e_score_correction_bias in fp32 itself)
    # what `checkpoint.save_dtype: auto` writes back (a bf16 Hub checkpoint trained in fp32
    # is exported as bf16 again); where the weights come from (a meta model is filled later)
    model.checkpoint_dtype = stored
    model.name_or_path = local_dir
    if device.type == "meta":  # checked, not read: hybridtrain.distributed.materialize fills it
        return model.eval()
    model.to_empty(device=device)

    state = model.state_dict(keep_vars=True)
    # the tensors were created on the meta device; to_empty gave them storage, we fill each one
    with torch.no_grad():
        for path in files:
            with open_safetensors(path, device=str(device)) as f:
                for k in f.keys():
                    ours, expert = hub_name_to_ours(hub.get(k, k))
                    if ours not in state:  # (check_tensors let only IGNORED_ON_LOAD through)
                        continue
                    target = state[ours]
                    if expert is not None:
                        target = target[expert]
                    target.copy_(hub_layout(ours, f.get_tensor(k), layout_config(config), to_hub=False))
    return model.eval()


# ---------------------------------------------------------------------------------- saving
def save_hf_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    config: NemotronHConfig,
    save_dir: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    layout_config: NemotronHConfig | None = None,
) -> None:
    """Write our (full, unsharded) state dict as a Hub checkpoint: safetensors shards of at most
    ``max_shard_size`` (+ index when more than one), and config.json.

    ``tensors``: the full tensors as ``(name, tensor)`` pairs in ``state_dict``'s order, made
    one at a time while the files are written (e.g. gathered from shards); ``state_dict`` then
    only gives names, shapes and dtypes (meta tensors will do) and at most one output file's
    tensors are held at a time.

    ``layout_config``: the Nemotron-H config whose Mamba rows :func:`hub_layout` reorders
    (default ``config``; a model holding a Nemotron-H inside passes its language config).

    ``dtype``: write the floating-point tensors in this dtype (None: as they are); the tensors
    transformers keeps in fp32 (``e_score_correction_bias``) stay fp32 either way.

    Written into a temporary directory next to ``save_dir`` first. A new ``save_dir`` appears by
    one rename; an existing one has its files replaced one by one (stale weight files are removed,
    other files such as a tokenizer are kept).
    """
    save_dir = os.path.abspath(os.fspath(save_dir))
    limit = parse_size(max_shard_size)
    layout_config = config if layout_config is None else layout_config
    items = list(hub_tensors(state_dict, layout_config))
    dtype = parse_dtype(dtype)

    def out_dtype(name: str, t: torch.Tensor) -> torch.dtype:  # each tensor is cast as it is written
        if dtype is None or not t.is_floating_point() or name.endswith(_KEEP_FP32):
            return t.dtype
        return dtype

    float_dtypes = Counter(out_dtype(n, t) for n, t in items if t.is_floating_point() and not n.endswith(_KEEP_FP32))
    main_dtype = float_dtypes.most_common(1)[0][0] if float_dtypes else torch.float32

    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        nbytes = t.numel() * out_dtype(name, t).itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    parent = os.path.dirname(save_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(save_dir)}.tmp-", dir=parent)
    try:
        weight_map = {}
        total = 0
        source = iter(items) if tensors is None else (
            x for n, t in tensors for x in hub_tensors({n: t}, layout_config))
        for fname, shard in zip(names, shards):
            out = {}
            for name, _ in shard:
                got, t = next(source)
                assert got == name, f"tensors out of order: {got} where {name} was expected"
                # a fresh contiguous CPU tensor per entry (expert slices share storage otherwise)
                out[name] = t.detach().to("cpu", dtype=out_dtype(name, t), copy=True).contiguous()
                del t
                weight_map[name] = fname
                total += out[name].nbytes
            save_file(out, os.path.join(tmp, fname), metadata={"format": "pt"})
            del out
        if n > 1:
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(config.to_json_string(dtype=dtype_name(main_dtype)))
        apply_umask(tmp)  # mkdtemp makes it 0700, safetensors writes 0600
        _publish(tmp, save_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: str, save_dir: str) -> None:
    if not os.path.exists(save_dir):
        os.rename(tmp, save_dir)
        return
    if not os.path.isdir(save_dir):
        raise ValueError(f"{save_dir} exists and is not a directory")
    new = set(os.listdir(tmp))
    # weights first, the index and config.json last
    for fn in sorted(new, key=lambda x: (x in (INDEX_FILE, CONFIG_FILE), x)):
        os.replace(os.path.join(tmp, fn), os.path.join(save_dir, fn))
    os.rmdir(tmp)
    for fn in os.listdir(save_dir):  # weight files of an older save that the new one does not have
        if fn not in new and (fn == INDEX_FILE or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", fn)):
            os.remove(os.path.join(save_dir, fn))


def save_pretrained(
    model: nn.Module,
    save_dir: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> None:
    sd = model.state_dict() if state_dict is None else state_dict
    save_hf_checkpoint(sd, model.config, save_dir, max_shard_size=max_shard_size, dtype=dtype)
