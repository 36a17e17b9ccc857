"""A model of a training step's GPU time, built from a CPU trace of that step.

Every operator the step runs (a CPU profiler event with its input shapes and dtypes: the leaf
``aten`` ops, i.e. the kernels) gets a GPU time from a roofline::

    time = max(FLOPs / gemm_flops, bytes read + written / bandwidth) + launches * launch_s

(defaults: one H100 in bf16, 700 TFLOP/s, 3 TB/s, 5 us per kernel launch). Bytes read are the
inputs' bytes; bytes written follow from the op (an in-place op writes its first input, a GEMM
its product, a reduction ~nothing, an elementwise op the broadcast of its inputs in the promoted
dtype, ...). FLOPs are counted for GEMMs and attention only (everything else is memory-bound).
Each kernel falls in one category, by precedence: the context it ran in (optimizer step, loss,
Mamba scan/conv: the enclosing autograd functions and Python frames; for autograd's own backward
nodes, the context of the forward op that made them), then the op (GEMM/attention, dtype casts),
then norms/activations, MoE routing/permutation, other.

:func:`extrapolate` carries a trace taken at reduced sizes to the real ones: of two traces of
the same step at two scales, every tensor dimension that differs between them is a scaled one
(a width, a length, a count of tokens) and grows to the real scale; the others (counts of heads,
experts, rows) stay. FLOPs and bytes are then computed from the real shapes.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace

DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8,
               "int": 4, "short int": 2, "bool": 1, "unsigned char": 1, "signed char": 1,
               "c10::complex<float>": 8}

CATEGORIES = ("GEMM + attention", "loss", "casts", "norms/activations", "Mamba scan + conv",
              "MoE routing/permutation", "optimizer", "other")

# ops that move no data (views, allocation, metadata)
NO_WORK = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::as_strided", "aten::view",
           "aten::_reshape_alias", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
           "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select",
           "aten::detach", "detach", "aten::resolve_conj", "aten::resolve_neg", "aten::alias",
           "aten::lift_fresh", "aten::unbind", "aten::split", "aten::split_with_sizes",
           "aten::chunk", "aten::narrow", "aten::view_as", "aten::unflatten", "aten::flatten",
           "aten::numpy_T", "aten::_unsafe_view", "aten::set_", "aten::item",
           "aten::_local_scalar_dense", "aten::is_nonzero", "aten::result_type", "aten::size",
           "aten::stride", "aten::diagonal", "aten::expand_as", "aten::contiguous", "aten::to",
           "aten::_to_copy", "aten::zeros", "aten::zeros_like", "aten::ones_like",
           "aten::empty_permuted", "aten::new_empty", "aten::new_empty_strided", "aten::type_as",
           "aten::record_stream", "aten::_has_compatible_shallow_copy_type", "aten::promote_types"}
GEMMS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_grouped_mm",
         "aten::addbmm", "aten::_scaled_mm"}
ATTENTION = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|_cudnn_attention")
REDUCTIONS = re.compile(r"aten::(sum|mean|amax|amin|max|min|norm|linalg_vector_norm|argmax|argmin|"
                        r"logsumexp|std|var|all|any|prod|_foreach_norm|count_nonzero|bincount|histc)$")
OVERWRITE = {"aten::copy_", "aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_",
             "aten::random_"}
MULTI_TENSOR_CHUNK = 320 * 65536  # elements per multi_tensor_apply launch (CUDA, depth 4)

# (regex on the enclosing context, category): first match wins
CONTEXT_RULES = (
    (re.compile(r"Optimizer\.step|torch/optim/|_fused_adam|clip_grad|_foreach_"), "optimizer"),
    (re.compile(r"CrossEntropy|ops/loss\.py|LinearCrossEntropy|cross_entropy"), "loss"),
    (re.compile(r"ChunkScan|CausalConv1d|_ssd|ssd_|chunk_scan|causal_conv|kernels\.py|selective"),
     "Mamba scan + conv"),
)
NORM_ACT = re.compile(r"RMSNorm|rms_norm|norm\.py|_norm|GatedNorm|act_fn|relu|silu|sigmoid|"
                      r"softplus|gelu|tanh|rsqrt|Relu|Silu|Sigmoid|Softplus|Pow")
NORM_ACT_OPS = re.compile(r"aten::(relu|silu|sigmoid|softplus|gelu|tanh|rsqrt|pow|"
                          r"(relu|silu|sigmoid|softplus|gelu|tanh)_backward|threshold_backward|"
                          r"_softmax|_softmax_backward_data)")
MOE = re.compile(r"moe\.py|permute|route|MoE|expert|topk|bincount|argsort|index_add|scatter|gather")


@dataclass(frozen=True)
class Hardware:
    """The roofline's constants (defaults: one H100 SXM, bf16 dense GEMMs, HBM3)."""

    gemm_flops: float = 700e12
    bandwidth: float = 3e12
    launch_s: float = 5e-6
    name: str = "H100 (700 TFLOP/s, 3 TB/s, 5 us/launch)"


@dataclass
class Kernel:
    """One operator of the step: its tensor inputs as (shape, bytes per element), the shapes of
    its tensor-list inputs (multi-tensor ops, ``cat``, ``index``), and its category. Bytes,
    FLOPs and launches follow from these (:func:`cost`)."""

    name: str
    category: str
    tensors: list[tuple[list[int], int]]
    lists: list[list[list[int]]] = field(default_factory=list)
    cast: bool = False
    site: str = ""  # the innermost project source line it ran from (file.py(line): function)

    @property
    def cost(self) -> tuple[int, int, float, int]:
        return cost(self.name, self.tensors, self.lists)

    @property
    def read_bytes(self) -> int:
        return self.cost[0]

    @property
    def write_bytes(self) -> int:
        return self.cost[1]

    @property
    def bytes(self) -> int:
        r, w, _, _ = self.cost
        return r + w

    @property
    def flops(self) -> float:
        return self.cost[2]

    @property
    def launches(self) -> int:
        return self.cost[3]

    def seconds(self, hw: Hardware) -> float:
        r, w, f, n = self.cost
        return max(f / hw.gemm_flops, (r + w) / hw.bandwidth) + n * hw.launch_s


# -- costs from shapes --------------------------------------------------------------------------
def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def _broadcast(shapes: list[list[int]]) -> list[int]:
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        for i, d in enumerate([1] * (n - len(s)) + list(s)):
            out[i] = max(out[i], d)
    return out


def cost(name: str, ts: list[tuple[list[int], int]], lists: list[list[list[int]]],
         list_itemsize: int = 4) -> tuple[int, int, float, int]:
    """(bytes read, bytes written, FLOPs, kernel launches) of op ``name`` on tensors ``ts``
    ((shape, bytes per element) each) and tensor lists ``lists`` (their elements' shapes; their
    dtype is not recorded: ``list_itemsize``)."""
    shapes = [s for s, _ in ts]
    read = sum(_numel(s) * b for s, b in ts)
    list_numel = [sum(_numel(s) for s in lst) for lst in lists]
    flops = 0.0
    if lists and (name.startswith("aten::_foreach") or name.startswith("aten::_fused")):
        n = max(list_numel)
        if "adam" in name:  # params, grads, exp_avg, exp_avg_sq read; three of them written
            lr, lw = 4, 3
        elif name == "aten::_foreach_norm":
            lr, lw = 1, 0
        else:  # in place over the first list, reading the others
            lr, lw = len([x for x in list_numel if x]), 1
        launches = max(1, math.ceil(n / MULTI_TENSOR_CHUNK))
        return lr * n * list_itemsize, lw * n * list_itemsize, 0.0, launches
    read += sum(list_numel) * list_itemsize
    if not ts and not lists:
        return 0, 0, 0.0, 1
    if name in GEMMS:
        flops, (n, b) = _gemm(name, ts)
        return read, n * b, flops, 1
    if ATTENTION.search(name) and len(ts) >= 3:
        flops, (n, b) = _attention(name, ts)
        return read, n * b, flops, 1
    if name == "aten::copy_" or name in OVERWRITE:  # writes its first input, reads the rest
        return read - _numel(shapes[0]) * ts[0][1], _numel(shapes[0]) * ts[0][1], 0.0, 1
    if name in ("aten::index_add_", "aten::index_put_", "aten::scatter_add_", "aten::scatter_",
                "aten::index_copy_", "aten::masked_scatter_", "aten::scatter_reduce_"):
        src = _numel(shapes[-1]) if ts else list_numel[-1]  # rows of the source read + written
        return read - _numel(shapes[0]) * ts[0][1] + src * ts[0][1], src * ts[0][1], 0.0, 1
    if name.endswith("_"):  # in place: reads and writes its first input
        return read, _numel(shapes[0]) * ts[0][1], 0.0, 1
    if REDUCTIONS.match(name) or name in ("aten::topk", "aten::nonzero"):
        return read, 0, 0.0, 1
    itemsize = max((b for _, b in ts), default=list_itemsize)
    if name in ("aten::cat", "aten::stack"):
        return read, sum(list_numel) * list_itemsize, 0.0, 1
    if name == "aten::index" and ts and lists:  # self[indices]: index elements x trailing dims
        idx = lists[0]
        n = _numel(_broadcast(idx)) * _numel(shapes[0][len(idx):])
        return read - _numel(shapes[0]) * ts[0][1] + n * ts[0][1], n * ts[0][1], 0.0, 1
    if name in ("aten::index_select", "aten::embedding") and len(ts) >= 2:
        w, idx = shapes[0], shapes[-1]
        n = _numel(idx) * (_numel(w[1:]) if name == "aten::embedding" else _numel(w) // max(w[0], 1))
        return n * ts[0][1] + _numel(idx) * ts[-1][1], n * ts[0][1], 0.0, 1
    if name in ("aten::gather",):
        n = _numel(shapes[-1])
        return 2 * n * ts[0][1], n * ts[0][1], 0.0, 1
    if name in ("aten::sort", "aten::argsort"):
        return read, 2 * read, 0.0, 1
    return read, _numel(_broadcast(shapes)) * itemsize, 0.0, 1


def _gemm(name: str, ts) -> tuple[float, tuple[int, int]]:
    """(FLOPs, output (numel, bytes per element)) of a GEMM from its inputs' shapes."""
    shapes = [s for s, _ in ts]
    three = name in ("aten::addmm", "aten::baddbmm", "aten::addbmm")
    a, b = (shapes[1], shapes[2]) if three else shapes[:2]
    itemsize = ts[1][1] if three else ts[0][1]
    if name == "aten::_grouped_mm":  # (tokens, k) x (groups, k, n)
        return 2.0 * a[0] * a[-1] * b[-1], (a[0] * b[-1], itemsize)
    batch = _numel(a[:-2])
    m, k, n = a[-2], a[-1], b[-1]
    return 2.0 * batch * m * k * n, (batch * m * n, itemsize)


def _attention(name: str, ts) -> tuple[float, tuple[int, int]]:
    """(FLOPs, output) of a causal SDPA forward/backward from q [B, H, L, D], k [B, Hk, S, D]."""
    (q, bq), (k, _) = (ts[1], ts[2]) if "backward" in name else (ts[0], ts[1])
    fwd = 2.0 * _numel(q[:-2]) * q[-2] * k[-2] * q[-1]  # QK^T and PV over half the square
    if "backward" in name:
        return 2.5 * fwd, (3 * _numel(q), bq)
    return fwd, (_numel(q), bq)


# -- from profiler events to kernels ------------------------------------------------------------
def _context(ev, by_seq: dict) -> str:
    """The names of ``ev``'s enclosing events (autograd functions, Python frames) joined; inside
    a backward node, also the context of the forward op that made it (by sequence number)."""
    names, e = [], ev.cpu_parent
    while e is not None:
        names.append(e.name)
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr in by_seq:
            names.append(by_seq[e.sequence_nr])
        e = e.cpu_parent
    return " | ".join(names)


SITE = re.compile(r"hybridtrain/(.+?\.py\(\d+\): \w+)")


def _site(context: str) -> str:
    """The innermost project frame of ``context`` (``models/nemotron_h/moe.py(113): unpermute``)."""
    m = SITE.search(context)
    return m.group(1) if m else ""


def _category(name: str, context: str, cast: bool) -> str:
    for rx, cat in CONTEXT_RULES:
        if rx.search(context) or rx.search(name):
            return cat
    if name in GEMMS or ATTENTION.search(name):
        return "GEMM + attention"
    if cast:
        return "casts"
    if NORM_ACT_OPS.match(name) or NORM_ACT.search(context):
        return "norms/activations"
    if MOE.search(context) or MOE.search(name):
        return "MoE routing/permutation"
    return "other"


def _is_kernel(ev) -> bool:
    return ev.name.startswith("aten::") and ev.name not in NO_WORK


def _has_kernel_inside(ev) -> bool:
    stack = list(ev.cpu_children)
    while stack:
        c = stack.pop()
        if _is_kernel(c):
            return True
        stack.extend(c.cpu_children)
    return False


def _float_dtypes(ev) -> set:
    return {d for d in ev.input_dtypes if d in ("float", "c10::BFloat16", "c10::Half", "double")}


def _is_cast(ev) -> bool:
    dts = [d for d in ev.input_dtypes if d in DTYPE_BYTES]
    return ev.name == "aten::copy_" and len(dts) >= 2 and dts[0] != dts[1]


def _promotes_on_cpu_only(ev) -> bool:
    """An elementwise op on mixed float dtypes (``bf16 * fp32``, or an ``out=`` of another
    dtype) whose only kernels inside are casts, or a reduction into a wider ``dtype=`` (casts
    and the fill of its output inside): the CPU's TensorIterator makes those casts as
    temporaries, a GPU kernel converts as it loads and stores. One kernel on the GPU."""
    if not ev.name.startswith("aten::") or ev.name in NO_WORK or ev.name in GEMMS:
        return False
    reduction = REDUCTIONS.match(ev.name) is not None
    if not reduction and len(_float_dtypes(ev)) < 2:
        return False
    stack, found = list(ev.cpu_children), False
    while stack:
        c = stack.pop()
        if _is_kernel(c):
            if not (_is_cast(c) or (reduction and c.name == "aten::fill_")):
                return False
            found = True
        else:
            stack.extend(c.cpu_children)
    return found


def kernels_of(events) -> list[Kernel]:
    """The step's kernels from profiler ``events`` (``prof.events()`` of a trace with
    ``record_shapes=True``; with ``with_stack=True`` Python frames add context): every aten op
    that does work and has no such op inside it, except that an op on mixed float dtypes is one
    kernel with the casts the CPU makes for it (:func:`_promotes_on_cpu_only`)."""
    events = list(events)
    fused = {id(ev) for ev in events if _promotes_on_cpu_only(ev)}

    def inside_fused(ev) -> bool:
        e = ev.cpu_parent
        while e is not None:
            if id(e) in fused:
                return True
            e = e.cpu_parent
        return False

    by_seq: dict[int, str] = {}  # forward ops' context by the sequence number of their node
    for ev in events:
        if ev.sequence_nr >= 0 and ev.sequence_nr not in by_seq and not ev.name.startswith("autograd::"):
            ctx = _context(ev, {})
            if "autograd::engine" not in ctx:
                by_seq[ev.sequence_nr] = ev.name + " | " + ctx
    out = []
    for ev in events:
        if id(ev) not in fused and (not _is_kernel(ev) or _has_kernel_inside(ev) or inside_fused(ev)):
            continue
        name = "aten::fill_" if ev.name == "aten::zero_" else ev.name  # zero_ is fill_ (or runs it)
        ts, lists = [], []
        for shape, dtype, structured in zip(ev.input_shapes, ev.input_dtypes,
                                            ev.structured_input_shapes or ev.input_shapes):
            if dtype in DTYPE_BYTES:
                ts.append((list(shape), DTYPE_BYTES[dtype]))
            elif dtype == "TensorList":
                lists.append([list(s) for s in structured])
        cast = _is_cast(ev)
        ctx = _context(ev, by_seq)
        out.append(Kernel(name, _category(name, ctx, cast), ts, lists, cast, _site(ctx)))
    return out


# -- reduced sizes -> real sizes ----------------------------------------------------------------
def extrapolate(small: list[Kernel], large: list[Kernel], to_scale: float) -> list[Kernel]:
    """Kernels at ``to_scale`` times ``large``'s sizes, from two traces of the same step at two
    scales (``small``, ``large``): every dimension that differs between the two grows by
    ``to_scale`` (a scaled width, or a count of tokens, e.g. routed to one expert); the others
    (counts of heads, experts, rows) stay."""
    if [k.name for k in small] != [k.name for k in large]:
        raise ValueError("the two traces run different operator sequences; cannot extrapolate")

    def grow(s: list[int], l: list[int]) -> list[int]:
        if len(s) != len(l):
            return list(l)
        return [int(b * to_scale) if a != b else b for a, b in zip(s, l)]

    out = []
    for s, l in zip(small, large):
        ts = [(grow(a, b), nb) for (a, _), (b, nb) in zip(s.tensors, l.tensors)]
        lists = [[grow(a, b) for a, b in zip(la, lb)] if len(la) == len(lb) else lb
                 for la, lb in zip(s.lists, l.lists)]
        out.append(replace(l, tensors=ts, lists=lists))
    return out


# -- the table ----------------------------------------------------------------------------------
@dataclass
class Row:
    count: int = 0
    launches: int = 0
    bytes: int = 0
    flops: float = 0.0
    seconds: float = 0.0
    names: dict = field(default_factory=lambda: defaultdict(float))


def by_category(kernels: list[Kernel], hw: Hardware) -> dict[str, Row]:
    rows = {c: Row() for c in CATEGORIES}
    for k in kernels:
        r = rows[k.category]
        t = k.seconds(hw)
        r.count += 1
        r.launches += k.launches
        r.bytes += k.bytes
        r.flops += k.flops
        r.seconds += t
        r.names[k.name] += t
    return rows


def casts(kernels: list[Kernel]) -> tuple[int, int]:
    """(count, bytes) of the dtype-changing copies anywhere in the step."""
    cs = [k for k in kernels if k.cast]
    return len(cs), sum(k.bytes for k in cs)


def cast_sites(kernels: list[Kernel], top: int = 12) -> str:
    """The dtype-changing copies grouped by call site and direction, biggest first: count, GB,
    the largest shape."""
    rows: dict = {}
    for k in kernels:
        if k.cast:
            (dst, bd), (src, bs) = k.tensors[0], k.tensors[1]
            key = (k.site or "(torch internals / autocast)", f"{8 * bs}->{8 * bd} bit")
            r = rows.setdefault(key, [0, 0, []])
            r[0], r[1] = r[0] + 1, r[1] + k.bytes
            if _numel(dst) > _numel(r[2]):
                r[2] = dst
    lines = [f"  {n:>4} x {b / 1e9:8.3f} GB  {d:<12} max {list(s)}  {site}"
             for (site, d), (n, b, s) in sorted(rows.items(), key=lambda x: -x[1][1])[:top]]
    return "\n".join(lines)


def table(kernels: list[Kernel], hw: Hardware, reference_ms: dict | None = None) -> str:
    """The step by category: kernels, launches, GB moved, TFLOP, estimated ms (and the measured
    ms with the error where ``reference_ms`` has the category)."""
    rows = by_category(kernels, hw)
    total = sum(r.seconds for r in rows.values())
    ref = reference_ms or {}
    lines = [f"{'category':<24}{'kernels':>8}{'launches':>9}{'GB':>9}{'TFLOP':>8}{'est. ms':>9}"
             f"{'%':>6}" + (f"{'meas. ms':>10}{'error':>8}" if ref else "") + "  top ops (est. ms)"]
    for c, r in rows.items():
        top = ", ".join(f"{n.removeprefix('aten::')} {t * 1e3:.1f}"
                        for n, t in sorted(r.names.items(), key=lambda x: -x[1])[:3])
        line = (f"{c:<24}{r.count:>8}{r.launches:>9}{r.bytes / 1e9:>9.2f}{r.flops / 1e12:>8.2f}"
                f"{r.seconds * 1e3:>9.1f}{100 * r.seconds / max(total, 1e-12):>6.1f}")
        if ref:
            m = ref.get(c)
            line += f"{m:>10.1f}{_err(r.seconds * 1e3, m):>8}" if m is not None else " " * 18
        lines.append(line + "  " + top)
    n = sum(r.count for r in rows.values())
    tb = sum(r.bytes for r in rows.values()) / 1e9
    tf = sum(r.flops for r in rows.values()) / 1e12
    line = f"{'total':<24}{n:>8}{sum(r.launches for r in rows.values()):>9}{tb:>9.2f}{tf:>8.2f}" \
           f"{total * 1e3:>9.1f}{100.0:>6.1f}"
    if ref and "total" in ref:
        line += f"{ref['total']:>10.1f}{_err(total * 1e3, ref['total']):>8}"
    lines.append(line)
    return "\n".join(lines)


def _err(est: float, meas: float) -> str:
    return f"{100 * (est - meas) / meas:+.0f}%"
