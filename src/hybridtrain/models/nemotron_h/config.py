"""Nemotron-H configuration, read from and written to a Hugging Face ``config.json``.

Field names and defaults are those of ``transformers.NemotronHConfig`` so that a ``config.json``
means the same thing to us and to ``transformers``. Accepted spellings of the layer layout:

* ``hybrid_override_pattern``: a string, one character per layer: ``M`` Mamba2, ``*`` attention,
  ``-`` MLP, ``E`` MoE;
* ``layers_block_type`` / ``layer_types``: a list, in the current names (``linear_attention``,
  ``full_attention``, ``mlp``, ``moe``) or the legacy ones (``mamba``, ``attention``).

Legacy field aliases (``mamba_n_groups``, ``mamba_d_conv``, ``attention_head_dim``, ...) are mapped
to the current names. Internally layer types are stored in the current names.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hybridtrain.fileio import read_json, text_reader

from .mlp import ACTIVATIONS

# one character per layer type, as in `hybrid_override_pattern`
PATTERN_TO_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
TYPE_TO_PATTERN = {v: k for k, v in PATTERN_TO_TYPE.items()}
LEGACY_TYPE_NAMES = {"mamba": "linear_attention", "attention": "full_attention"}
LAYER_TYPES = tuple(TYPE_TO_PATTERN)
# an MTP depth's layers when config.json names none (transformers' default)
DEFAULT_MTP_LAYER_TYPES = ("full_attention", "moe")

# legacy key -> current key (the legacy key wins only when the current one is absent)
FIELD_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "mamba_d_state": "ssm_state_size",
    "mamba_headdim": "mamba_head_dim",
    "mamba_nheads": "mamba_num_heads",
    "attention_head_dim": "head_dim",
    "rms_norm_eps": "layer_norm_epsilon",
    "num_local_experts": "n_routed_experts",
}

# keys that are not stored as fields but are understood (layout spellings, derived values)
_LAYOUT_KEYS = ("hybrid_override_pattern", "layers_block_type", "layer_types", "num_hidden_layers")
# keys of a source config.json that we drop when writing one (we never ship remote code)
# (architectures / model_type / dtype are written from the model itself)
_DROP_ON_WRITE = ("auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "architectures", "model_type")

_INF = float("inf")


def _to_float(value: Any, name: str) -> float:
    """Floats as written by json (Infinity), by transformers v5 ({"__float__": "Infinity"})."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"config field `{name}`: cannot read {value!r} as a number") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"config field `{name}`: expected a number, got {value!r}")


@dataclass
class NemotronHConfig:
    """Architecture hyper-parameters of a Nemotron-H model (names as on the Hub)."""

    model_type: ClassVar[str] = "nemotron_h"

    layers_block_type: list[str] = field(
        default_factory=lambda: ["linear_attention", "moe", "full_attention", "mlp"]
    )
    vocab_size: int = 131072
    hidden_size: int = 4096
    tie_word_embeddings: bool = False
    # attention
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    attention_dropout: float = 0.0
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    # MLP
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # Mamba2
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    expand: int = 2  # unused by the architecture (mamba_num_heads * mamba_head_dim is), kept for the Hub
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_limit: tuple[float, float] = (0.0, _INF)
    time_step_floor: float = 1e-4
    use_conv_bias: bool = True
    chunk_size: int = 128
    mamba_proj_bias: bool = False
    use_bias: bool = False  # bias of the Mamba in_proj / out_proj
    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    moe_shared_expert_overlap: bool = True
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    # multi-token prediction: `num_nextn_predict_layers` depths, each the layers of
    # `mtp_layers_block_type` (Hub tensors `mtp.layers.{i}.*`, see mtp.py)
    num_nextn_predict_layers: int = 0
    mtp_layers_block_type: list[str] | None = None
    # norms, init, misc
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True
    residual_in_fp32: bool = False
    hidden_dropout: float = 0.0
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    # keys of the source config.json we do not interpret, written back unchanged
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.layers_block_type = _normalize_layer_types(list(self.layers_block_type), "layers_block_type")
        if self.mtp_layers_block_type is None and self.num_nextn_predict_layers:
            self.mtp_layers_block_type = list(DEFAULT_MTP_LAYER_TYPES)  # as transformers
        if self.mtp_layers_block_type is not None:
            self.mtp_layers_block_type = _normalize_layer_types(
                list(self.mtp_layers_block_type), "mtp_layers_block_type"
            )
        lim = self.time_step_limit
        if not isinstance(lim, (list, tuple)) or len(lim) != 2:
            raise ValueError(f"config field `time_step_limit` must be a pair [min, max], got {lim!r}")
        self.time_step_limit = (_to_float(lim[0], "time_step_limit"), _to_float(lim[1], "time_step_limit"))
        for name in ("time_step_min", "time_step_max", "time_step_floor", "routed_scaling_factor"):
            setattr(self, name, _to_float(getattr(self, name), name))
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    @property
    def hybrid_override_pattern(self) -> str:
        return "".join(TYPE_TO_PATTERN[t] for t in self.layers_block_type)

    @property
    def mtp_hybrid_override_pattern(self) -> str | None:
        if self.mtp_layers_block_type is None:
            return None
        return "".join(TYPE_TO_PATTERN[t] for t in self.mtp_layers_block_type)

    @property
    def num_mtp_layers(self) -> int:
        """Layers under ``mtp.layers``: every depth's pattern, depth after depth."""
        if not self.num_nextn_predict_layers:
            return 0
        return self.num_nextn_predict_layers * len(self.mtp_layers_block_type)

    @property
    def all_layer_types(self) -> set[str]:
        """The layer types of the main stack and of the MTP layers."""
        return set(self.layers_block_type) | set(self.mtp_layers_block_type or ())

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def dt_limit(self) -> tuple[float, float]:
        """Clamp applied to dt = softplus(dt + dt_bias).

        ``transformers`` (and NVIDIA's reference PyTorch path) clamp from below at
        ``time_step_min``; the config's ``time_step_limit`` can only tighten that.
        With the Hub default ``time_step_limit = (0, inf)`` this is exactly transformers' clamp.
        """
        return (max(self.time_step_min, self.time_step_limit[0]), self.time_step_limit[1])

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"config field `{name}`: {msg}")

        need(len(self.layers_block_type) > 0, "layers_block_type", "the model needs at least one layer")
        for name in (
            "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups",
            "conv_kernel", "chunk_size", "n_routed_experts", "moe_intermediate_size",
            "num_experts_per_tok", "n_group", "topk_group",
        ):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive integer, got {v!r}")
        n_mtp = self.num_nextn_predict_layers
        need(isinstance(n_mtp, int) and not isinstance(n_mtp, bool) and n_mtp >= 0,
             "num_nextn_predict_layers", f"must be an integer >= 0, got {n_mtp!r}")
        if n_mtp:
            need(len(self.mtp_layers_block_type) > 0, "mtp_layers_block_type",
                 "an MTP depth needs at least one layer")
        types = self.all_layer_types if n_mtp else set(self.layers_block_type)
        if "full_attention" in types:
            need(
                self.num_attention_heads % self.num_key_value_heads == 0,
                "num_key_value_heads",
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
            )
        if "linear_attention" in types:
            need(
                self.mamba_num_heads % self.n_groups == 0,
                "n_groups",
                f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of n_groups ({self.n_groups})",
            )
            need(self.mamba_hidden_act in ("silu", "swish"), "mamba_hidden_act",
                 f"only 'silu' is supported, got {self.mamba_hidden_act!r}")
            lo, hi = self.dt_limit
            need(0.0 <= lo < hi, "time_step_limit", f"needs 0 <= min < max, got {self.time_step_limit}")
        if "moe" in types:
            E = self.n_routed_experts
            need(E % self.n_group == 0, "n_group", f"n_routed_experts ({E}) must be a multiple of n_group ({self.n_group})")
            need(self.topk_group <= self.n_group, "topk_group",
                 f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
            per_group = E // self.n_group
            if self.n_group > 1:
                # the group score is the sum of the top-2 expert scores of the group (as in transformers)
                need(per_group >= 2, "n_group", f"each expert group needs >= 2 experts, got {per_group}")
            need(
                self.num_experts_per_tok <= self.topk_group * per_group,
                "num_experts_per_tok",
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts available in "
                f"topk_group ({self.topk_group}) groups of {per_group}",
            )
            if self.moe_latent_size is not None:
                need(isinstance(self.moe_latent_size, int) and self.moe_latent_size > 0, "moe_latent_size",
                     f"must be a positive integer or null, got {self.moe_latent_size!r}")
        if types & {"mlp", "moe"}:
            need(self.mlp_hidden_act in ACTIVATIONS, "mlp_hidden_act",
                 f"unknown activation {self.mlp_hidden_act!r}; known: {sorted(ACTIVATIONS)}")
        need(not self.tie_word_embeddings, "tie_word_embeddings", "Nemotron-H uses an untied lm_head")

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "NemotronHConfig":
        """Build from a ``config.json`` dict (current or legacy spelling)."""
        d = dict(d)
        mt = d.get("model_type", "nemotron_h")
        if mt != "nemotron_h":
            raise ValueError(f"{source}: `model_type` is {mt!r}, expected 'nemotron_h'")
        for old, new in FIELD_ALIASES.items():
            if old in d:
                val = d.pop(old)
                if new in d and d[new] != val:
                    raise ValueError(
                        f"{source}: `{old}` ({val!r}) and `{new}` ({d[new]!r}) disagree; keep only `{new}`"
                    )
                d.setdefault(new, val)
        # layer layout
        pattern = d.pop("hybrid_override_pattern", None)
        lbt = d.pop("layers_block_type", None)
        lt = d.pop("layer_types", None)
        n_layers = d.pop("num_hidden_layers", None)
        if lbt is not None and lt is not None and list(lbt) != list(lt):
            raise ValueError(f"{source}: `layers_block_type` and `layer_types` disagree")
        types = lbt if lbt is not None else lt
        field_name = "layers_block_type" if lbt is not None else "layer_types"
        if types is not None:
            if not isinstance(types, (list, tuple)):
                raise ValueError(f"{source}: `{field_name}` must be a list of strings, got {types!r}")
            types = _normalize_layer_types(list(types), field_name)
        if pattern is not None:
            from_pattern = pattern_to_layer_types(pattern)
            if types is not None and types != from_pattern:
                raise ValueError(
                    f"{source}: `hybrid_override_pattern` ({pattern!r}) disagrees with `{field_name}`"
                )
            types = from_pattern
            field_name = "hybrid_override_pattern"
        if types is None:
            types = cls.__dataclass_fields__["layers_block_type"].default_factory()
        if n_layers is not None and n_layers != len(types):
            raise ValueError(
                f"{source}: `num_hidden_layers` is {n_layers} but `{field_name}` describes {len(types)} layers"
            )
        mtp_pattern = d.pop("mtp_hybrid_override_pattern", None)
        if mtp_pattern is not None:
            from_pattern = pattern_to_layer_types(mtp_pattern, "mtp_hybrid_override_pattern")
            listed = d.get("mtp_layers_block_type")
            if listed is not None and _normalize_layer_types(list(listed), "mtp_layers_block_type") != from_pattern:
                raise ValueError(f"{source}: `mtp_hybrid_override_pattern` ({mtp_pattern!r}) disagrees "
                                 "with `mtp_layers_block_type`; keep one of them")
            d["mtp_layers_block_type"] = from_pattern
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "layers_block_type"}
        kwargs = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known and k not in _LAYOUT_KEYS and k not in _DROP_ON_WRITE}
        if "time_step_limit" in kwargs and kwargs["time_step_limit"] is not None:
            kwargs["time_step_limit"] = tuple(kwargs["time_step_limit"])
        elif "time_step_limit" in kwargs:
            kwargs.pop("time_step_limit")
        return cls(layers_block_type=types, extra=extra, **kwargs)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "NemotronHConfig":
        return cls.from_dict(read_json(path), source=str(path))

    @classmethod
    def from_pretrained(cls, local_dir: str | os.PathLike) -> "NemotronHConfig":
        path = os.path.join(local_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{local_dir}: no config.json (expected a local Hugging Face model directory)")
        return cls.from_json_file(path)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers.NemotronHForCausalLM`` loads.

        Writes the current field names plus ``hybrid_override_pattern`` and ``num_hidden_layers``
        (read by older tools; transformers ignores them when ``layers_block_type`` is present).
        """
        out: dict[str, Any] = {k: v for k, v in self.extra.items() if k not in _DROP_ON_WRITE}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        out["layers_block_type"] = list(self.layers_block_type)
        out["hybrid_override_pattern"] = self.hybrid_override_pattern
        out["num_hidden_layers"] = self.num_hidden_layers
        if self.mtp_layers_block_type is None:
            out.pop("mtp_layers_block_type")
        else:  # the spelling vLLM and SGLang read, beside transformers' list
            out["mtp_hybrid_override_pattern"] = self.mtp_hybrid_override_pattern
        out["architectures"] = ["NemotronHForCausalLM"]
        out["model_type"] = "nemotron_h"
        if dtype is not None:
            out["dtype"] = dtype
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        return self.to_hf_dict()

    def to_json_string(self, dtype: str | None = None) -> str:
        # json writes inf as `Infinity`, as the Hub's Nemotron-H config.json files do
        return json.dumps(self.to_hf_dict(dtype), indent=2, sort_keys=True) + "\n"

    def replace(self, **changes: Any) -> "NemotronHConfig":
        """A copy with some fields changed (accepts `hybrid_override_pattern` too)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if "hybrid_override_pattern" in changes:
            d["layers_block_type"] = pattern_to_layer_types(changes.pop("hybrid_override_pattern"))
        d.update(changes)
        return type(self)(**d)


text_reader("model config")(NemotronHConfig.from_json_file)


def pattern_to_layer_types(pattern: str, name: str = "hybrid_override_pattern") -> list[str]:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"config field `{name}` must be a non-empty string, got {pattern!r}")
    out = []
    for i, ch in enumerate(pattern):
        if ch not in PATTERN_TO_TYPE:
            raise ValueError(
                f"config field `{name}`: unknown layer character {ch!r} at position {i} of {pattern!r}; "
                f"use M (Mamba2), * (attention), - (MLP) or E (MoE)"
            )
        out.append(PATTERN_TO_TYPE[ch])
    return out


def _normalize_layer_types(types: list[str], name: str) -> list[str]:
    out = []
    for i, t in enumerate(types):
        t2 = LEGACY_TYPE_NAMES.get(t, t)
        if t2 not in TYPE_TO_PATTERN:
            raise ValueError(
                f"config field `{name}`: unknown layer type {t!r} at index {i}; use one of "
                f"{list(LAYER_TYPES)} (or legacy 'mamba' / 'attention')"
            )
        out.append(t2)
    return out
