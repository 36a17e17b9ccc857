"""Mixture-of-experts layer of Nemotron-H.

Routing (as transformers / DeepSeek-V3 "noaux_tc"): router logits in fp32 -> sigmoid scores;
``e_score_correction_bias`` is added for expert *selection* only; selection is group-limited
(keep the ``topk_group`` best of ``n_group`` groups, a group scored by the sum of its two best
experts) then top-k; the gate weights are the un-biased scores of the chosen experts, optionally
renormalised (``norm_topk_prob``), times ``routed_scaling_factor``. A shared expert (dense MLP)
is added to every token.

The token flow is split into steps: ``route`` -> ``permute`` (sort token copies by expert) ->
``token_dispatcher(experts, sorted, counts)`` -> ``unpermute`` (undo the sort, weight and sum the
k copies of each token). The dispatcher is a plain attribute: a ``LocalDispatcher`` (calls
``experts(sorted, counts)``) unless expert parallelism gave the layer its all-to-all dispatcher
(``hybridtrain.distributed.expert_parallel``); ``Experts`` computes with the local shards of its
weights, so the same code runs on all experts or on this rank's share of them.

Experts are stacked weights, ``up_proj [E, I, H]`` and ``down_proj [E, H, I]`` (as transformers
holds them; the Hub stores one ``experts.{j}.up_proj.weight`` per expert, see ``hf_io``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridtrain.distributed.context_parallel import gather_sequence
from hybridtrain.distributed.expert_parallel import LocalDispatcher, zero_rows_output
from hybridtrain.distributed.utils import local_tensor
from hybridtrain.ops import backend
from hybridtrain.ops.backend import pad_rows, unpad_rows
from hybridtrain.ops.grouped_rows import aligned_groups, group_row_multiple

from .config import NemotronHConfig
from .mlp import ACTIVATIONS, MLP
from .numerics import fp32_region, matmul_dtype, mul_to

def sequence_balance_loss(logits: torch.Tensor, topk_idx: torch.Tensor, rows: int, cp=None) -> torch.Tensor:
    """The sequence-level auxiliary balance loss (DeepSeek-V3's, Megatron's ``seq_aux_loss``),
    summed over the ``rows`` rows of a forward: per row, ``sum_i f_i * P_i`` with ``f_i`` expert
    i's token copies in the row times ``E / (k L)``,
    and ``P_i`` the row's mean of the tokens' sigmoid scores normalised over the experts.
    ``logits`` [rows L, E] fp32, ``topk_idx`` [rows L, k].

    ``cp`` (a ``ContextParallel``; the forward holds this rank's slice of every row): ``f``
    counts the whole rows (the ranks' counts summed) and ``P`` sums this slice's share of the
    whole rows' mean, so the ranks' values sum to the whole rows' loss (``f`` takes no gradient:
    each rank's gradient is its slice's part)."""
    E, k = logits.shape[-1], topk_idx.shape[-1]
    scores = logits.sigmoid().view(rows, -1, E)
    L = scores.shape[1]
    parts = cp.size if cp is not None else 1
    p = (scores / scores.sum(-1, keepdim=True)).mean(1) / parts  # [rows, E]: this slice's share
    with torch.no_grad():
        counts = torch.zeros(rows, E, dtype=p.dtype, device=p.device)
        counts.scatter_add_(1, topk_idx.view(rows, L * k), torch.ones(rows, L * k, dtype=p.dtype, device=p.device))
        if parts > 1:  # the whole rows' counts, of L * cp positions
            counts = gather_sequence(counts[:, None], 1, cp).sum(1)
    return (counts * (E / (k * L * parts)) * p).sum()


class TopkRouter(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        # updated by the load-balancing rule, never by gradients; always kept in fp32
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        # with `count_tokens`: the last forward's token copies per expert [E] int64 (training's
        # expert load, hybridtrain.ops.expert_load); not part of the state
        self.count_tokens = False
        self.tokens_per_expert: torch.Tensor | None = None
        # with `seq_aux_loss`: the last forward's sequence-level balance loss, summed over rows
        self.seq_aux_loss = False
        self.last_seq_aux: torch.Tensor | None = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.config.initializer_range)
        self.e_score_correction_bias.zero_()

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` must not round the correction bias (transformers keeps it in
        # fp32 too): cast it back after any module-wide conversion
        super()._apply(fn, recurse)
        if self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = self.e_score_correction_bias.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (router_logits [T, E] fp32, topk_weights [T, k] fp32, topk_idx [T, k]).

        All of it in fp32 whatever the parameter dtype or autocast (logits, sigmoid, the
        correction bias, group / top-k selection and the gate weights)."""
        with fp32_region(x):
            return self._route(x)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        with torch.no_grad():
            choice = scores + self.e_score_correction_bias.float()
            if self.n_group > 1:
                T = choice.shape[0]
                grouped = choice.view(T, self.n_group, self.num_experts // self.n_group)
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
                group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
                group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
                expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(T, self.num_experts)
                choice = choice.masked_fill(~expert_mask, float("-inf"))
            topk_idx = choice.topk(self.top_k, dim=-1, sorted=False).indices
            if self.count_tokens:  # overwritten, not summed: a recomputed forward counts once
                flat = topk_idx.reshape(-1)
                self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device
                                                     ).index_add_(0, flat, torch.ones_like(flat))
        weights = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        return logits, weights, topk_idx


def permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, dtype: torch.dtype | None = None):
    """Sort the k copies of each token by expert.

    x [T, H], topk_idx [T, k] -> (sorted_x [T*k, H], order [T*k], counts [E], x_cast [T, H])
    where ``sorted_x[i] = x_cast[order[i] // k]`` and expert e owns rows
    ``sum(counts[:e]) : sum(counts[:e+1])``. ``dtype`` (the experts' compute dtype, e.g.
    autocast's bf16): ``x_cast`` is x cast to it once (x itself without ``dtype``), and the copies
    are made from it (:class:`_GatherCopies`), not cast after as T*k rows; other readers of the
    tokens in that dtype (the shared expert) take ``x_cast``. In backward each token's k
    gradients are put back in token order and summed (a permutation and a sum, in every dtype),
    never scattered with accumulation (serial on a CPU, atomics or a sort on CUDA).
    """
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # (not bincount: its output shape depends on the data, a graph break under torch.compile;
    # a comparison, not a scatter: deterministic without atomics)
    counts = (flat[:, None] == torch.arange(num_experts, device=flat.device)).sum(0)
    dtype = x.dtype if dtype is None else dtype
    x_cast, sorted_x = _GatherCopies.apply(x, order, k, dtype)
    # in x's own dtype the other readers take x itself: their gradients reach it as autograd
    # sums them, beside the copies' (the same sums as a plain x[order // k] gather)
    return sorted_x, order, counts, (x if dtype == x.dtype else x_cast)


class _GatherCopies(torch.autograd.Function):
    """(``x.to(dtype)``, its rows ``order // k``): the cast on the T tokens, then their k copies
    gathered in ``dtype``. Backward sums each token's k gradients and the cast's own in x's
    dtype (fp32; one reduction that converts as it reads), as autograd summed the fp32
    gradients of the casts of the tokens and of their copies, not in bf16."""

    @staticmethod
    def forward(ctx, x, order, k, dtype):
        ctx.save_for_backward(order)
        ctx.k, ctx.x_dtype = k, x.dtype
        x_cast = x.to(dtype)
        return x_cast, x_cast.index_select(0, order // k)

    @staticmethod
    def backward(ctx, g_cast, g):
        (order,) = ctx.saved_tensors
        copies = g.index_select(0, inverse_permutation(order))  # token-major again, [T*k, H]
        gx = copies.view(-1, ctx.k, g.shape[-1]).sum(1, dtype=ctx.x_dtype)
        return (gx if g_cast is None else gx.add_(g_cast)), None, None, None


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i``: rows put back by ``order`` are gathered by ``inv``
    (a gather of rows is several times cheaper than the scatter ``y[order] = rows``)."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


class _Permute(torch.autograd.Function):
    """``x.index_select(0, perm)`` for a permutation ``perm`` whose inverse is ``inverse``: the
    gradient is gathered back by ``inverse`` (autograd's would be a scatter-add)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return g.index_select(0, inverse), None, None


def unpermute(y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute`, then the gate-weighted sum over each token's k experts (fp32).
    Deterministic (no scatter-add)."""
    T, k = topk_weights.shape
    y = _Permute.apply(y_sorted, inverse_permutation(order), order)
    return gate_weighted_sum(y.view(T, k, -1), topk_weights)


def gate_weighted_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * y[t, k] in fp32 for y [T, k, H], weights [T, k] (fp32). No fp32 copy
    of y: the product promotes a bf16 y exactly, in the same kernel; y's gradient is written in
    y's dtype by the product that forms it."""
    return _GateWeightedSum.apply(y, weights)


class _GateWeightedSum(torch.autograd.Function):
    """:func:`gate_weighted_sum` with the gradients autograd forms for ``(y * w.float()).sum(1)``,
    y's rounded to its dtype as it is written (:func:`mul_to`) instead of cast after."""

    @staticmethod
    def forward(ctx, y, weights):
        ctx.save_for_backward(y, weights)
        return (y * weights[:, :, None].float()).sum(dim=1)

    @staticmethod
    def backward(ctx, gout):
        y, weights = ctx.saved_tensors
        g = gout[:, None, :]
        gy = mul_to(g, weights[:, :, None].float(), y.dtype)
        gw = (g * y).sum(-1)
        return gy, gw.to(weights.dtype)


def decode_grouped_mm(h: torch.Tensor, intermediate_size: int) -> bool:
    """Whether a decoding step's experts over the rows ``h`` run as ``grouped_mm`` with the
    offsets read on the device only (a CUDA graph can replay it): ``training.grouped_mm`` on, rows
    of 16-byte multiples (the kernel's alignment), and a kernel that reads no host value: the CPU
    one (its offsets are host memory already; any dtype in eager, bf16 compiled) or the CUDA bf16
    kernel of sm90 / sm100 (torch's other CUDA form copies the offsets to the host). The rows'
    compute dtype is autocast's where it is on."""
    if not (backend.settings().grouped_mm and hasattr(F, "grouped_mm")):
        return False
    dtype = matmul_dtype(h)
    if any(n * dtype.itemsize % 16 for n in (h.shape[-1], intermediate_size)):
        return False
    if h.device.type == "cpu":  # (compiled: its fake form takes bf16 only, as the CUDA kernel)
        return dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    return h.is_cuda and dtype == torch.bfloat16 and torch.cuda.get_device_capability(h.device)[0] in (9, 10)


class Experts(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.n_routed_experts
        in_dim = config.moe_latent_size if config.moe_latent_size is not None else config.hidden_size
        self.up_proj = nn.Parameter(torch.empty(self.num_experts, config.moe_intermediate_size, in_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, in_dim, config.moe_intermediate_size))
        self.act_fn = ACTIVATIONS[config.mlp_hidden_act]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.up_proj, mean=0.0, std=self.config.initializer_range)
        nn.init.normal_(self.down_proj, mean=0.0, std=self.config.initializer_range)

    def forward(self, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """sorted_x [N, H] grouped by expert, counts [E] rows per expert -> [N, H] (``E``: the
        experts this module holds locally; all of them without expert parallelism)."""
        up, down, sorted_x = self.compute_weights(sorted_x)
        if group_row_multiple(up) > 1:  # float8 weights (torchao): their one float8 form, no fallback
            return self._grouped(sorted_x, up, down, counts)
        if backend.grouped_experts(sorted_x, (up.shape[1],)):
            # one grouped GEMM per projection, offsets on the device: no host sync
            if torch.compiler.is_compiling():
                return self._grouped(sorted_x, up, down, counts)
            try:
                return self._grouped(sorted_x, up, down, counts)
            except RuntimeError as e:  # e.g. a GPU/torch build without the kernel
                backend.disable_grouped_mm(f"torch grouped_mm failed ({e})")
        if torch.compiler.is_compiling():
            return self._dense_masked(sorted_x, up, down, counts)
        # a loop over experts on contiguous slices (never over tokens). The stacked weights are
        # split once (one gradient buffer in backward, not a zero-filled [E, ...] buffer per expert)
        ups, downs = up.unbind(0), down.unbind(0)
        outs = []
        for e, xe in enumerate(torch.split(sorted_x, counts.tolist())):
            n = xe.shape[0]
            if n == 0:
                continue
            xe = pad_rows(xe)  # routed row counts change every step: aligned GEMM rows (ops.backend)
            ye = F.linear(self.act_fn(F.linear(xe, ups[e])), downs[e])
            outs.append(unpad_rows(ye, n))
        if not outs:
            return zero_rows_output(self, sorted_x, up.shape[2])
        return torch.cat(outs, dim=0)

    def compute_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(up, down, x) as the experts compute with them: the local shards, under autocast all
        three in its dtype (the stacked weights cast once, not per expert)."""
        up, down = local_tensor(self.up_proj), local_tensor(self.down_proj)
        device_type = x.device.type
        if device_type in ("cpu", "cuda", "xpu") and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            up, down, x = up.to(dtype), down.to(dtype), x.to(dtype)
        return up, down, x

    def _grouped(self, sorted_x: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        multiple = group_row_multiple(up)
        if multiple > 1:  # float8 experts (torchao's grouped GEMM): groups of aligned rows
            return aligned_groups(sorted_x, counts, multiple,
                                  lambda rows, offs: self._grouped_mm(rows, up, down, offs))
        return self._grouped_mm(sorted_x, up, down, torch.cumsum(counts, 0, dtype=torch.int32))

    def _grouped_mm(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                    offs: torch.Tensor) -> torch.Tensor:
        h = F.grouped_mm(x, up.transpose(1, 2), offs=offs)
        return F.grouped_mm(self.act_fn(h), down.transpose(1, 2), offs=offs)

    def _dense_masked(self, sorted_x: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                      counts: torch.Tensor) -> torch.Tensor:
        """The compiled form where ``grouped_mm`` does not apply (it takes bf16 only): every
        expert over every row, each row keeping its own expert's output. No host count, E times
        the FLOPs of the loop."""
        ends = torch.cumsum(counts, 0)
        expert = torch.searchsorted(ends, torch.arange(sorted_x.shape[0], device=ends.device), right=True)
        y = torch.zeros(sorted_x.shape[0], up.shape[2], dtype=sorted_x.dtype, device=sorted_x.device)
        for e in range(up.shape[0]):
            ye = F.linear(self.act_fn(F.linear(sorted_x, up[e])), down[e])
            y = torch.where((expert == e)[:, None], ye, y)
        return y


class MoE(nn.Module):
    def __init__(self, config: NemotronHConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.gate = TopkRouter(config)
        self.experts = Experts(config)
        self.shared_experts = MLP(config, intermediate_size=config.moe_shared_expert_intermediate_size)
        # how the sorted token rows reach the experts (expert parallelism sets an all-to-all one)
        self.token_dispatcher = LocalDispatcher()
        if config.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(config.hidden_size, config.moe_latent_size, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(config.moe_latent_size, config.hidden_size, bias=config.mlp_bias)
        else:
            self.fc1_latent_proj = None
            self.fc2_latent_proj = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.gate.reset_parameters()
        self.experts.reset_parameters()
        self.shared_experts.reset_parameters()
        for lin in (self.fc1_latent_proj, self.fc2_latent_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, mean=0.0, std=self.config.initializer_range)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    def route(self, x: torch.Tensor):
        return self.gate(x)

    def forward(self, hidden_states: torch.Tensor, cp=None) -> torch.Tensor:
        """``hidden_states`` [B, L, H]; ``cp``: the forward's context-parallel group, where the
        rows are this rank's slices (the sequence-level balance loss reads whole rows)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, topk_weights, topk_idx = self.route(x)
        if self.gate.seq_aux_loss:
            self.gate.last_seq_aux = sequence_balance_loss(logits, topk_idx, shape[0], cp)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        sorted_h, order, counts, h_cast = permute(h, topk_idx, self.experts.num_experts, matmul_dtype(h))
        y_sorted = self.token_dispatcher(self.experts, sorted_h, counts)
        y = unpermute(y_sorted, order, topk_weights).to(hidden_states.dtype)
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
        # the shared expert reads the tokens' one cast where the routed experts read it too
        shared_in = h_cast.view(shape) if self.fc1_latent_proj is None and h_cast is not h else hidden_states
        return y.view(shape) + self.shared_experts(shared_in)

    # ------------------------------------------------------------------ cached decoding
    def step(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer for the few tokens of a decoding step (one per row): the chosen experts
        only, as :meth:`forward`. With the local experts, outside the eager CPU forms
        (``ops.backend.cpu_decode_forms``), all on the device with fixed shapes and no host value
        (a captured CUDA graph replays it) and without copying expert weights: the token copies
        sorted by expert and one grouped GEMM per projection where the kernel takes its offsets
        on the device (:func:`decode_grouped_mm`), else every local expert over the step's few
        tokens (:meth:`_experts_dense`). Else grouped by expert on the host (a few ints),
        through the token dispatcher (expert parallelism)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, idx = self.route(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        local = type(self.experts) is Experts and type(self.token_dispatcher) is LocalDispatcher
        if not local or backend.cpu_decode_forms(x, fp32=False):
            y = self._experts_host_grouped(h, weights, idx, local)
        elif decode_grouped_mm(h, self.experts.up_proj.shape[1]):
            y = self._experts_grouped(h, weights, idx)
        else:
            y = self._experts_dense(h, weights, idx)
        y = y.to(hidden_states.dtype)
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
        return y.view(shape) + self.shared_experts.step(hidden_states)

    def _experts_grouped(self, h: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Gate-weighted sum (fp32) of each token's k experts, h [T, H], idx [T, k], as the
        training forward computes it: the T k copies sorted by expert on the device, one
        ``grouped_mm`` per projection over the stacked weights as they are, unsorted."""
        ex = self.experts
        up, down, h = ex.compute_weights(h)
        sorted_h, order, counts, _ = permute(h, idx, ex.num_experts, up.dtype)
        return unpermute(ex._grouped(sorted_h, up, down, counts), order, weights)

    def _experts_dense(self, h: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """As :meth:`_experts_grouped` where that kernel does not apply: every local expert over
        the step's T tokens, one product per projection over the stacked weights as they are
        (each weight read once, E / k times the chosen experts' FLOPs), then each token's k
        outputs picked. Outputs are [T, E I] and [E, T, H]: no weight-sized temporary."""
        ex = self.experts
        up, down, h = ex.compute_weights(h)
        E, I, H = up.shape
        T = h.shape[0]
        a = ex.act_fn(F.linear(h.to(up.dtype), up.reshape(E * I, H))).view(T, E, I)
        y = torch.matmul(a.transpose(0, 1), down.transpose(1, 2))  # [E, T, H]
        return gate_weighted_sum(y[idx, torch.arange(T, device=y.device)[:, None]], weights)

    def _experts_host_grouped(self, h: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                              local: bool) -> torch.Tensor:
        """As :meth:`_experts_grouped`, the copies grouped by expert on the host."""
        T, k = idx.shape
        flat = idx.view(-1).tolist()
        if T == 1 and local:
            # one token (batch 1): its k experts one after the other, no grouping at all
            ex = self.experts
            ys = [F.linear(ex.act_fn(F.linear(h, ex.up_proj[e])), ex.down_proj[e]) for e in flat]
            return gate_weighted_sum(torch.cat(ys)[None], weights)
        order = sorted(range(T * k), key=flat.__getitem__)  # copies grouped by expert (stable)
        counts = [0] * self.experts.num_experts
        for e in flat:
            counts[e] += 1
        # every row of the sorted copies is the one token when T == 1: no gather
        sorted_h = h.expand(k, -1) if T == 1 else h[torch.tensor([i // k for i in order], device=h.device)]
        y_sorted = self.token_dispatcher(self.experts, sorted_h, torch.tensor(counts, device=h.device))
        inverse = [0] * (T * k)
        for pos, i in enumerate(order):
            inverse[i] = pos
        # as unpermute: back to the k copies of each token, gate-weighted sum over them in fp32
        return gate_weighted_sum(y_sorted[torch.tensor(inverse, device=h.device)].view(T, k, -1), weights)
