"""LoRA: adapter-aware linear and experts modules, target selection, merging.

``apply_lora(model, dim, alpha, ...)`` replaces each selected module *in place* by an adapter-aware
subclass that keeps the base parameters (same ``Parameter`` objects, same names) and adds:

* ``nn.Linear`` -> :class:`LoRALinear`: ``y = x W^T + b + s * B(A(dropout(x)))`` with
  ``lora_A [r, in]``, ``lora_B [out, r]`` and ``s = alpha / r``;
* MoE experts (a model spec's ``expert_modules``: stacked ``up_proj [E, I, H]``,
  ``down_proj [E, H, I]``) -> :class:`LoRAExperts`: one adapter per expert and projection,
  ``up_proj_lora_A [E, r, H]``, ``up_proj_lora_B [E, I, r]`` (same for ``down_proj``), applied to
  each expert's rows inside the grouped / per-expert-loop compute.

Base parameter names are unchanged (``backbone.layers.3.mixer.q_proj.weight``), so checkpoints
and Hub I/O see the same names; the adapters are ``<module>.lora_A`` / ``<module>.lora_B`` and
``<experts>.{up,down}_proj_lora_{A,B}``. Under tensor parallelism a LoRA linear is split with its
base (``distributed.tensor_parallel.AdaptedLinearParallel``: ``lora_B`` with a column-wise
base's output rows, ``lora_A`` with a row-wise base's input columns). Every base parameter is frozen (``requires_grad =
False``): an optimizer built from the parameters that require grad sees only the adapters, and a
checkpoint taken with ``ignore_frozen_params`` holds only the adapters.

Target selection: candidate names are the module names of every ``nn.Linear`` except ``lm_head``
(the chunked loss reads its weight directly), plus ``<experts>.up_proj`` / ``<experts>.down_proj``
for each MoE experts module (whose Hub names are ``<experts>.{j}.up_proj``; a pattern may use
either form but cannot select some experts only). A pattern is a glob (``fnmatch``) matched
against the whole dotted name or a dotted suffix of it: ``q_proj`` == ``*.q_proj``,
``mixer.in_proj`` matches ``backbone.layers.0.mixer.in_proj``. No ``target_modules`` (and
``match_all_linear`` false) means every candidate, as ``match_all_linear: true``; a recipe's
``peft:`` section must say which (the loader refuses false with no ``target_modules``).
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridtrain.distributed.activation_checkpoint import state_dict_name
from hybridtrain.distributed.expert_parallel import zero_rows_output
from hybridtrain.distributed.utils import local_tensor
from hybridtrain.distributed.tensor_parallel import grads_in_own_placements
from hybridtrain.ops import backend
from hybridtrain.models.spec import PeftSupport, model_spec_for
from hybridtrain.peft.quant import dense, is_nf4, quantize_weights

__all__ = [
    "LoRALinear",
    "LoRAExperts",
    "apply_lora",
    "lora_modules",
    "has_lora",
    "is_lora_param",
    "lora_state_dict",
    "load_lora_state_dict",
    "init_lora_weights",
    "lora_settings",
    "merge_lora",
    "merged_state_dict",
    "quantize_base",
    "base_weight_shapes",
    "base_quant_of",
    "dense_shapes",
    "dequantized",
]

logger = logging.getLogger(__name__)

EXPERT_PROJS = ("up_proj", "down_proj")
EXCLUDED_LINEARS = ("lm_head",)
_LORA_PARAM = re.compile(r"(^|\.|_)lora_[AB]$")


def is_lora_param(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter tensor."""
    return bool(_LORA_PARAM.search(name))


def _adopt(new: nn.Module, base: nn.Module) -> None:
    """Give ``new`` (an uninitialised subclass instance) the attributes, parameters, buffers and
    children of ``base`` -- the very same objects, nothing copied."""
    nn.Module.__init__(new)
    for k, v in vars(base).items():
        if not k.startswith("_") and k != "training":
            object.__setattr__(new, k, v)
    new.training = base.training
    for n, p in base._parameters.items():
        new.register_parameter(n, p)
    for n, b in base._buffers.items():
        new.register_buffer(n, b, persistent=n not in base._non_persistent_buffers_set)
    for n, m in base._modules.items():
        new.add_module(n, m)


def _init_pair(A: torch.Tensor, B: torch.Tensor) -> None:
    """A ~ kaiming_uniform(a=sqrt(5)) over its input dim (U(-1/sqrt(in), 1/sqrt(in)), per expert
    for stacked [E, r, in] tensors), B = 0: the adapted model starts equal to the base."""
    with torch.no_grad():
        bound = 1.0 / math.sqrt(A.shape[-1])
        A.uniform_(-bound, bound)
        B.zero_()


def _dropout(p: float) -> nn.Module:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"peft.dropout must be in [0, 1), got {p}")
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * B(A(x)) in the adapter dtype, returned in x's dtype.

    A power-of-two scale (alpha / r = 4 for r 8, alpha 32) multiplies ``A`` ([r, in]) instead of
    the output ([rows, out]): scaling by 2^k is exact and commutes with every rounding of the two
    products and their gradients, so outputs and gradients are bit for bit the same (barring
    values at the edge of the float range)."""
    if math.frexp(scale)[0] == 0.5:
        return F.linear(F.linear(x.to(A.dtype), A * scale), B).to(x.dtype)
    return (F.linear(F.linear(x.to(A.dtype), A), B) * scale).to(x.dtype)


def _folds(x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor,
           dropout: nn.Module) -> bool:
    """Whether the adapter is folded into the base weight for input ``x`` (:class:`_FoldedLinear`):
    a frozen base of plain tensors in the adapters' dtype (no tensor parallelism, no quantized
    base, no dropout on the adapter's input, not compiled: the compiler fuses the unfolded form),
    and enough rows that ``B @ A`` ([out, in], rank-r products) costs less than the adapter's
    two rank-r products over the rows: rows x (in + out) > in x out."""
    if torch.compiler.is_compiling() or not isinstance(dropout, nn.Identity) or W.requires_grad:
        return False
    if bias is not None and bias.requires_grad:
        return False
    if any(type(t) not in (torch.Tensor, nn.Parameter) for t in (x, W, A, B)):
        return False
    if not x.dtype == W.dtype == A.dtype == B.dtype:
        return False
    out_features, in_features = W.shape
    return (x.numel() // in_features) * (in_features + out_features) > in_features * out_features


class _FoldedLinear(torch.autograd.Function):
    """``x (W + s B A)^T + bias`` for a frozen ``W``: over the rows, one product instead of three
    (the base's and the adapter's two rank-r ones) and no sum of two [rows, out] tensors;
    backward takes x's gradient through the folded weight (one product instead of two and a sum)
    and the adapters' from the rank-r products, each in the orientation the CPU BLAS runs
    fastest (``h = x A^T`` recomputed). The same sums as the unfolded form up to rounding (fp32:
    ~1e-7 relative)."""

    @staticmethod
    def forward(ctx, x, W, bias, A, B, s):
        ctx.save_for_backward(x, W, A, B)
        ctx.s = s
        return F.linear(x, torch.addmm(W, B, A, alpha=s), bias)

    @staticmethod
    def backward(ctx, g):
        x, W, A, B = ctx.saved_tensors
        s = ctx.s
        gx = g @ torch.addmm(W, B, A, alpha=s) if ctx.needs_input_grad[0] else None
        gA = None
        if ctx.needs_input_grad[3]:
            gh = F.linear(g, B.t().contiguous())  # g @ B, [rows, r]
            gA = (gh.t() @ x).mul_(s)
        gB = (F.linear(x, A).t() @ g).t().mul_(s) if ctx.needs_input_grad[4] else None  # s (h^T g)^T
        return gx, None, None, gA, gB, None


def adapter_dtype(base_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` if given; else fp32 for a half-precision base (as PEFT: bf16 adapters train
    poorly, and they are small), else the base dtype."""
    if dtype is not None:
        return dtype
    return torch.float32 if base_dtype in (torch.bfloat16, torch.float16) else base_dtype


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update (same ``weight``/``bias`` parameters as the base)."""

    def __init__(self, base: nn.Linear, dim: int, alpha: float, dropout: float = 0.0,
                 dtype: torch.dtype | None = None):
        _adopt(self, base)
        w = base.weight
        dtype = adapter_dtype(w.dtype, dtype)
        self.lora_dim, self.lora_alpha, self.lora_dropout_p = dim, alpha, float(dropout)
        self.scale = alpha / dim
        self.lora_dropout = _dropout(dropout)
        self.lora_A = nn.Parameter(torch.empty(dim, base.in_features, device=w.device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, dim, device=w.device, dtype=dtype))
        if w.device.type != "meta":
            self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        _init_pair(self.lora_A, self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        A, B = grads_in_own_placements(self.lora_A), grads_in_own_placements(self.lora_B)
        if x.is_contiguous() and _folds(x, self.weight, self.bias, A, B, self.lora_dropout):
            rows = x.view(-1, x.shape[-1])
            out = _FoldedLinear.apply(rows, self.weight, self.bias, A, B, self.scale)
            return out.view(*x.shape[:-1], -1)
        out = F.linear(x, self.weight, self.bias)
        # a contiguous [..., in] input: the adapter's two products on its rows [N, in] (the GEMMs
        # it folds into anyway), one view in and one out instead of a pair per product and per
        # gradient. x's gradient gets the same two terms in the same order (the base's, then the
        # adapter's through one view), so the sums are the unflattened form's.
        if x.dim() > 2 and x.is_contiguous():
            rows = x.view(-1, x.shape[-1])
            delta = _delta(self.lora_dropout(rows), A, B, self.scale).view(*x.shape[:-1], -1)
        else:
            delta = _delta(self.lora_dropout(x), A, B, self.scale)
        return out + delta.to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in fp32, [out, in]."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale

    def to_plain(self) -> nn.Linear:
        """An ``nn.Linear`` holding this module's (unmerged) weight and bias parameters."""
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = self.weight
        if self.bias is not None:
            plain.bias = self.bias
        plain.train(self.training)
        return plain

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_dim={self.lora_dim}, lora_alpha={self.lora_alpha}"


def expert_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The model's stacked-expert module classes (its spec's ``expert_modules``, and
    :class:`LoRAExperts`, which takes their place)."""
    try:
        peft = model_spec_for(model).find(PeftSupport)
        return (peft.expert_modules if peft else ()) + (LoRAExperts,)
    except ValueError:  # not a registered model: plain linear layers only
        return ()


class LoRAExperts(nn.Module):
    """MoE experts with one LoRA adapter per expert for each projection in ``projs``.

    Takes over a spec's expert module (same parameter objects and names: stacked
    ``up_proj [E, I, H]``, ``down_proj [E, H, I]``, ``act_fn`` between them) and, like it, runs
    ``forward(sorted_x, counts)`` on rows grouped by expert. Expert ``e``
    computes ``down(act(up(x)))`` with ``up(x) = x W_up[e]^T + s * x A_up[e]^T B_up[e]^T``.
    Adapter tensors are stacked over the expert dim like the base weights, so expert
    parallelism shards them with the experts.
    """

    def __init__(self, base: nn.Module, dim: int, alpha: float, dropout: float = 0.0,
                 projs: Sequence[str] = EXPERT_PROJS, dtype: torch.dtype | None = None):
        _adopt(self, base)
        self.base_cls = type(base)
        self.num_experts = base.up_proj.shape[0]  # the stacked tensors may become [E * out, in] (NF4)
        assert set(projs) <= set(EXPERT_PROJS), projs  # none: a frozen (e.g. NF4) base only
        self.lora_projs = tuple(p for p in EXPERT_PROJS if p in projs)
        self.lora_dim, self.lora_alpha, self.lora_dropout_p = dim, alpha, float(dropout)
        self.scale = alpha / dim
        self.lora_dropout = _dropout(dropout)
        for p in self.lora_projs:
            w = getattr(self, p)  # [E, out, in]
            E, out_f, in_f = w.shape
            kw = dict(device=w.device, dtype=adapter_dtype(w.dtype, dtype))
            self.register_parameter(f"{p}_lora_A", nn.Parameter(torch.empty(E, dim, in_f, **kw)))
            self.register_parameter(f"{p}_lora_B", nn.Parameter(torch.empty(E, out_f, dim, **kw)))
        if base.up_proj.device.type != "meta":
            self.reset_lora_parameters()

    def reset_parameters(self) -> None:
        """The base experts' own initialisation (the adapters': :meth:`reset_lora_parameters`)."""
        self.base_cls.reset_parameters(self)

    def reset_lora_parameters(self) -> None:
        for p in self.lora_projs:
            _init_pair(getattr(self, f"{p}_lora_A"), getattr(self, f"{p}_lora_B"))

    def _ab(self, proj: str, local: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The adapter pair of ``proj`` or None; ``local``: this rank's experts' shards."""
        if proj not in self.lora_projs:
            return None
        A, B = getattr(self, f"{proj}_lora_A"), getattr(self, f"{proj}_lora_B")
        return (local_tensor(A), local_tensor(B)) if local else (A, B)

    def forward(self, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        up, down = local_tensor(self.up_proj), local_tensor(self.down_proj)  # this rank's experts
        up_ab, down_ab = self._ab("up_proj", local=True), self._ab("down_proj", local=True)
        if up.dim() == 2 or down.dim() == 2:  # NF4 [E * out, in]: dequantised one expert at a time
            up, down = _per_expert(up, counts.numel()), _per_expert(down, counts.numel())
        elif (backend.settings().grouped_mm and sorted_x.is_cuda and sorted_x.dtype == torch.bfloat16
                and hasattr(F, "grouped_mm")):
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            try:
                return self._grouped(sorted_x, offs, up, down, up_ab, down_ab)
            except RuntimeError as e:  # e.g. a rank whose row size the kernel does not support
                backend.disable_grouped_mm(f"LoRA experts: torch grouped_mm failed ({e})")
        outs = []
        for e, xe in enumerate(torch.split(sorted_x, counts.tolist())):
            if xe.shape[0] == 0:
                continue
            h = F.linear(xe, up[e])
            if up_ab is not None:
                h = h + _delta(self.lora_dropout(xe), up_ab[0][e], up_ab[1][e], self.scale)
            h = self.act_fn(h)
            y = F.linear(h, down[e])
            if down_ab is not None:
                y = y + _delta(self.lora_dropout(h), down_ab[0][e], down_ab[1][e], self.scale)
            outs.append(y)
        if not outs:
            return zero_rows_output(self, sorted_x, down.shape[1])
        return torch.cat(outs, dim=0)

    def _grouped(self, x, offs, up, down, up_ab, down_ab) -> torch.Tensor:
        def proj(inp, w, ab):
            out = F.grouped_mm(inp, w.transpose(1, 2), offs=offs)
            if ab is not None:
                A, B = (t.to(inp.dtype) for t in ab)
                t = F.grouped_mm(self.lora_dropout(inp), A.transpose(1, 2), offs=offs)
                out = out + F.grouped_mm(t, B.transpose(1, 2), offs=offs) * self.scale
            return out

        return proj(self.act_fn(proj(x, up, up_ab)), down, down_ab)

    def delta_weight(self, proj: str) -> torch.Tensor:
        """scale * B[e] @ A[e] for every expert, fp32 [E, out, in]."""
        A, B = self._ab(proj)
        return torch.bmm(B.float(), A.float()) * self.scale

    def to_plain(self) -> nn.Module:
        with torch.device("meta"):
            plain = self.base_cls(self.config)
        plain.up_proj, plain.down_proj = self.up_proj, self.down_proj
        plain.train(self.training)
        return plain


LORA_TYPES = (LoRALinear, LoRAExperts)


def num_experts(mod: nn.Module) -> int:
    """The experts of a stacked-experts module (a :class:`LoRAExperts`' stacked tensors may be
    packed as ``[E * out, in]``)."""
    return mod.num_experts if isinstance(mod, LoRAExperts) else mod.up_proj.shape[0]


def frozen_experts(model: nn.Module) -> None:
    """Wrap every experts module LoRA did not adapt in a :class:`LoRAExperts` without adapters
    (the same settings as the model's adapters), which computes with packed (NF4) weights."""
    s = lora_settings(model)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, expert_types(model)) and not isinstance(mod, LoRAExperts):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    LoRAExperts(mod, s["dim"], s["alpha"], s["dropout"], projs=()))


def _per_expert(w: torch.Tensor, n: int):
    """Stacked expert weights indexable per expert: ``[E, out, in]`` as is, a quantised
    ``[E * out, in]`` as its ``E`` row blocks (views of the packed data: each expert is
    dequantised only when it has rows to compute)."""
    if w.dim() == 3:
        return w
    with torch.inference_mode(False):  # NF4's split outputs are views, which inference mode refuses
        return w.split(w.shape[0] // n)


# ---------------------------------------------------------------------------------- selection
def _candidates(model: nn.Module) -> dict[str, tuple[str, str | None]]:
    """Adaptable names -> (module name, expert projection or None), in model order."""
    out: dict[str, tuple[str, str | None]] = {}
    experts = expert_types(model)
    for name, mod in model.named_modules():
        if isinstance(mod, LORA_TYPES):
            raise ValueError(f"the model already has LoRA adapters ({name}); apply_lora once per model")
        if isinstance(mod, experts):
            for p in EXPERT_PROJS:
                out[f"{name}.{p}"] = (name, p)
        elif isinstance(mod, nn.Linear) and name.split(".")[-1] not in EXCLUDED_LINEARS:
            out[name] = (name, None)
    return out


def _match(pattern: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def _matches(pattern: str, cand: str, where: tuple[str, str | None], num_experts: dict[str, int],
             key: str) -> bool:
    """Does ``pattern`` select candidate ``cand``? Expert projections also match by Hub name
    (``<experts>.{j}.<proj>``), which must then hold for all experts or none."""
    if _match(pattern, cand):
        return True
    mod, proj = where
    if proj is None:
        return False
    hits = [_match(pattern, f"{mod}.{j}.{proj}") for j in range(num_experts[mod])]
    if any(hits) and not all(hits):
        raise ValueError(
            f"peft.{key}: pattern {pattern!r} selects only some experts of {mod} ({proj}); LoRA adapts "
            f"all experts of a layer or none -- use e.g. '{mod}.*.{proj}' or '*.experts.{proj}'"
        )
    return any(hits)


def _as_list(v, key: str) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) for p in v):
        raise ValueError(f"peft.{key} must be a list of glob strings, got {v!r}")
    return list(v)


def select_targets(model: nn.Module, target_modules=None, exclude_modules=None,
                   match_all_linear: bool = False) -> list[str]:
    """The candidate names (see module docstring) that the patterns select, in model order."""
    cands = _candidates(model)
    n_exp = {n: num_experts(m) for n, m in model.named_modules()
             if isinstance(m, expert_types(model))}
    targets = _as_list(target_modules, "target_modules")
    excludes = _as_list(exclude_modules, "exclude_modules")
    if not cands:
        raise ValueError(f"{type(model).__name__} has no linear layers or MoE experts LoRA could adapt")

    def no_match(key: str, pattern: str) -> ValueError:
        names = list(cands)
        shown = names[:6] + (["..."] if len(names) > 6 else [])
        leaves = sorted({n.split(".")[-1] for n in names})
        return ValueError(
            f"peft.{key}: pattern {pattern!r} matches no adaptable module. Patterns are globs over "
            f"dotted module names (a bare name matches as a suffix: 'q_proj' == '*.q_proj'). Valid "
            f"names ({len(names)}) look like: {', '.join(shown)}; leaf names: {', '.join(leaves)} "
            f"({', '.join(EXCLUDED_LINEARS)} is never adapted)"
        )

    if match_all_linear or not targets:
        selected = set(cands)
    else:
        selected = set()
        for pat in targets:
            hit = {c for c, w in cands.items() if _matches(pat, c, w, n_exp, "target_modules")}
            if not hit:
                raise no_match("target_modules", pat)
            selected |= hit
    for pat in excludes:
        hit = {c for c, w in cands.items() if _matches(pat, c, w, n_exp, "exclude_modules")}
        if not hit:
            raise no_match("exclude_modules", pat)
        selected -= hit
    if not selected:
        raise ValueError("peft: exclude_modules removes every targeted module; nothing left to adapt")
    return [c for c in cands if c in selected]


# ---------------------------------------------------------------------------------- apply
def apply_lora(
    model: nn.Module,
    dim: int = 8,
    alpha: float = 32,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str | None = None,
    exclude_modules: Sequence[str] | str | None = None,
    match_all_linear: bool = False,
    method: str = "lora",
    dtype: torch.dtype | None = None,
    base_quant: str | None = None,
) -> list[str]:
    """Add LoRA adapters to ``model`` in place and freeze everything else.

    Accepts the ``peft:`` recipe section as keyword arguments (``apply_lora(model, **cfg.peft)``).
    ``dtype``: adapter dtype (default: the base weight's, fp32 for a bf16/fp16 base). Returns the adapted names (module
    names; ``<experts>.up_proj`` / ``<experts>.down_proj`` for MoE experts). ``base_quant``:
    ``"nf4"`` stores the targets' frozen base weights in 4-bit NF4 (QLoRA, :mod:`.quant`).
    """
    if str(method).lower() != "lora":
        raise ValueError(f"peft.method: only 'lora' is supported, got {method!r}")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"peft.dim (LoRA rank) must be a positive integer, got {dim!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"peft.alpha must be a positive number, got {alpha!r}")
    _dropout(float(dropout))
    names = select_targets(model, target_modules, exclude_modules, match_all_linear)

    for p in model.parameters():
        p.requires_grad_(False)
    by_module: dict[str, list[str | None]] = {}
    for n in names:
        mod, proj = _resolve(model, n)
        by_module.setdefault(mod, []).append(proj)
    for mod_name, projs in by_module.items():
        parent_name, _, child = mod_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        if isinstance(base, expert_types(model)):
            new = LoRAExperts(base, dim, alpha, dropout, projs=projs, dtype=dtype)
        else:
            new = LoRALinear(base, dim, alpha, dropout, dtype=dtype)
        setattr(parent, child, new)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    n_exp = sum(1 for n in names if _resolve(model, n)[1] is not None)
    logger.info("LoRA r=%d alpha=%s: %d linear layers and %d expert projections adapted; trainable "
                "parameters %s of %s (%.3f%%)", dim, alpha, len(names) - n_exp, n_exp,
                f"{trainable:,}", f"{total:,}", 100.0 * trainable / max(total, 1))
    if base_quant is not None:
        quantize_base(model, base_quant)
    return names


def _resolve(model: nn.Module, name: str) -> tuple[str, str | None]:
    """Adapted name -> (module name, expert projection or None)."""
    head, _, last = name.rpartition(".")
    if last in EXPERT_PROJS and head and isinstance(model.get_submodule(head), expert_types(model)):
        return head, last
    return name, None


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear | LoRAExperts]]:
    """``(name, adapter module)`` pairs; names as state dicts spell them (no wrapper levels)."""
    for name, mod in model.named_modules():
        if isinstance(mod, LORA_TYPES):
            yield state_dict_name(name), mod


def has_lora(model: nn.Module) -> bool:
    return next(lora_modules(model), None) is not None


def lora_settings(model: nn.Module) -> dict:
    """``{dim, alpha, dropout, targets}`` of the model's adapters (all share one setting)."""
    mods = list(lora_modules(model))
    if not mods:
        raise ValueError("the model has no LoRA adapters (call apply_lora first)")
    settings = {(m.lora_dim, m.lora_alpha, m.lora_dropout_p) for _, m in mods}
    assert len(settings) == 1, f"adapters with different settings: {settings}"
    dim, alpha, dropout = settings.pop()
    targets = []
    for name, m in mods:
        targets += [f"{name}.{p}" for p in m.lora_projs] if isinstance(m, LoRAExperts) else [name]
    return {"dim": dim, "alpha": alpha, "dropout": dropout, "targets": targets}


@torch.no_grad()
def init_lora_weights(model: nn.Module) -> None:
    """(Re-)initialise every adapter (A uniform, B zero), e.g. after ``to_empty`` of a model
    built on the meta device."""
    for _, m in lora_modules(model):
        m.reset_lora_parameters()


def adapter_init_units(model: nn.Module) -> list[tuple[str, tuple[str, str], Callable]]:
    """The adapters' initialisation one pair at a time, for a model built on the meta device:
    ``(key, (A name, B name), make)`` where ``make()`` returns the pair's full CPU tensors
    (:func:`_init_pair` on the global RNG, which the caller seeds from ``key``)."""
    units = []
    for name, m in lora_modules(model):
        pre = f"{name}." if name else ""
        pairs = ([(f"{p}_lora_A", f"{p}_lora_B") for p in m.lora_projs]
                 if isinstance(m, LoRAExperts) else [("lora_A", "lora_B")])
        for a, b in pairs:
            A, B = getattr(m, a), getattr(m, b)

            def make(a=pre + a, b=pre + b, A=A, B=B):
                out = {a: torch.empty(A.shape, dtype=A.dtype), b: torch.empty(B.shape, dtype=B.dtype)}
                _init_pair(out[a], out[b])
                return out

            units.append((pre + a, (pre + a, pre + b), make))
    return units


# ---------------------------------------------------------------------------------- state dicts
def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only, under the model's parameter names (``...q_proj.lora_A``,
    ``...experts.up_proj_lora_A``). Detached, sharing storage (DTensors stay DTensors), so
    ``torch.distributed.checkpoint.load`` into it loads in place."""
    return {state_dict_name(n): p.detach() for n, p in model.named_parameters() if is_lora_param(n)}


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy adapter tensors (as returned by :func:`lora_state_dict`) into ``model``."""
    params = {state_dict_name(n): p for n, p in model.named_parameters() if is_lora_param(n)}
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(params))
    bad = [(n, tuple(state_dict[n].shape), tuple(params[n].shape)) for n in state_dict
           if n in params and tuple(state_dict[n].shape) != tuple(params[n].shape)]
    if bad or (strict and (missing or unexpected)):
        lines = ["LoRA state dict does not match the model's adapters:"]
        if missing:
            lines.append(f"  missing ({len(missing)}): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): {', '.join(unexpected[:8])}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
        lines += [f"  wrong shape: {n}: given {list(g)}, model has {list(m)}" for n, g, m in bad]
        raise ValueError("\n".join(lines))
    for n, t in state_dict.items():
        if n in params:
            params[n].copy_(t)


# ---------------------------------------------------------------------------------- merging
@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W += s * B @ A``, computed in fp32) and put the
    plain modules back; all parameters require grad again. Returns the model (changed in place)."""
    shapes = dense_shapes(model)  # an NF4 base (QLoRA): dequantised, then merged
    for name, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, LORA_TYPES)]:
        pre = f"{state_dict_name(name)}." if name else ""
        for attr in (EXPERT_PROJS if isinstance(mod, LoRAExperts) else ("weight",)):
            w = getattr(mod, attr)
            if pre + attr in shapes:
                w = nn.Parameter(dense(w, shapes[pre + attr]))
                setattr(mod, attr, w)
            if attr in EXPERT_PROJS and attr not in mod.lora_projs:
                continue
            delta = mod.delta_weight(attr) if attr in EXPERT_PROJS else mod.delta_weight()
            w.copy_((w.float() + delta).to(w.dtype))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, mod.to_plain())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def adapter_pairs(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """{base weight name: (A name, B name)} of the adapters among state-dict ``names``
    (``X.weight`` <- ``X.lora_A``/``X.lora_B``; stacked ``X.up_proj`` <- ``X.up_proj_lora_A``...)."""
    have, out = set(names), {}
    for n in names:
        if n.endswith("lora_A") and n[:-1] + "B" in have:
            base = n[:-len(".lora_A")] + ".weight" if n.endswith(".lora_A") else n[:-len("_lora_A")]
            out[base] = (n, n[:-1] + "B")
    return out


@torch.no_grad()
def merge_weight(w: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """``w + scale * B @ A`` computed in fp32 (per expert for stacked [E, ...] tensors), in
    ``w``'s dtype."""
    A, B = A.float(), B.float()
    delta = torch.bmm(B, A) if A.dim() == 3 else B @ A
    return (w.float() + delta.to(w.device) * scale).to(w.dtype)


@torch.no_grad()
def merged_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
    """A plain (adapter-free) state dict with the adapters folded in, from a LoRA model's full
    state dict (default ``model.state_dict()``; pass the gathered full state dict under FSDP).
    The model itself is not changed; an NF4 base (QLoRA) is dequantised first."""
    sd = dequantized(model, dict(model.state_dict() if state_dict is None else state_dict))
    for name, mod in lora_modules(model):
        pre = f"{name}." if name else ""
        projs = mod.lora_projs if isinstance(mod, LoRAExperts) else (None,)
        for p in projs:
            w_key = f"{pre}{p}" if p else f"{pre}weight"
            a_key, b_key = (f"{pre}{p}_lora_{x}" if p else f"{pre}lora_{x}" for x in "AB")
            sd[w_key] = merge_weight(sd[w_key], sd.pop(a_key), sd.pop(b_key), mod.scale)
    leftover = [k for k in sd if is_lora_param(k)]
    assert not leftover, leftover
    return sd


# -- QLoRA: the frozen base weights LoRA could adapt, stored in NF4 (peft/quant.py) --

def base_weights(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, int | None]]:
    """(name, owning module, attribute, experts) of every frozen base weight LoRA could adapt
    (every linear layer but ``lm_head``, every stacked-experts module: experts, None for a
    linear layer), adapted or not."""
    for name, mod in model.named_modules():
        pre = f"{state_dict_name(name)}." if name else ""
        if isinstance(mod, LoRAExperts):
            for proj in ("up_proj", "down_proj"):
                yield pre + proj, mod, proj, mod.num_experts
        elif isinstance(mod, nn.Linear) and name.split(".")[-1] not in EXCLUDED_LINEARS:
            yield pre + "weight", mod, "weight", None


def quantize_base(model: nn.Module, method: str = "nf4", shards: int = 1) -> dict[str, list[str]]:
    """Store every frozen linear and experts weight LoRA could adapt (adapted or not) in NF4
    (:func:`hybridtrain.peft.quant.quantize_weights`)."""
    frozen_experts(model)  # experts without adapters compute from NF4 too
    return quantize_weights(base_weights(model), method, shards)


def base_weight_shapes(model: nn.Module) -> dict[str, tuple[int | None, int, int]]:
    """{name: (experts or None, rows, cols)} of every base weight :func:`quantize_base` may store
    in NF4 (for :func:`hybridtrain.peft.quant.packer`)."""
    return {name: (experts, *getattr(mod, attr).shape) for name, mod, attr, experts in base_weights(model)}


def base_quant_of(model: nn.Module) -> str | None:
    """``"nf4"`` when ``model`` holds an NF4 base weight, else None."""
    return "nf4" if dense_shapes(model) else None


def dense_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """{name: unquantised shape} of ``model``'s NF4 base weights (stacked experts ``[E, out, in]``)."""
    out = {}
    for name, mod, attr, experts in base_weights(model):
        w = getattr(mod, attr)
        if is_nf4(w):
            out[name] = torch.Size((experts, w.shape[0] // experts, w.shape[1]) if experts else w.shape)
    return out


def dequantized(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (the model's names, whole tensors) with every NF4 base weight dequantised
    (:func:`dense`)."""
    shapes = dense_shapes(model)
    return {n: dense(t, shapes[n]) if n in shapes else t for n, t in state_dict.items()}
