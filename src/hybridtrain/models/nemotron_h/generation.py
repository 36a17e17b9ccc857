"""Cached decoding for Nemotron-H: :func:`prefill` runs the prompt once (the chunked scan, with its
final state kept) and fills a :class:`~.cache.NemotronHCache`; :func:`decode_step` feeds one
token per row: a Mamba2 layer takes one recurrent step (O(1) work and memory), an attention layer
attends over its key/value cache. :func:`generate` is ``NemotronHForCausalLM.generate``.

Batched prompts are left-padded (``attention_mask`` 0 before each prompt). During prefill the
padding is a document of its own (``seq_idx``): Mamba's conv and scan restart at the prompt and
attention never crosses into or out of it; the conv window kept for decoding holds zeros where
the padding was, and the key/value cache marks those positions invalid. So a padded prompt
decodes as it would alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridtrain.distributed.expert_parallel import LocalDispatcher
from hybridtrain.distributed.utils import local_tensor
from hybridtrain.ops.attention import document_causal_attention
from hybridtrain.ops.sampling import GenerationConfig, decode

from . import kernels, recurrent
from .attention import Attention
from .cache import KVCache, MambaState, NemotronHCache
from .mamba2 import Mamba2Mixer
from .mlp import MLP
from .moe import Experts, MoE
from .norms import RMSNorm, RMSNormGated


# ---------------------------------------------------------------------------------- projections
# A decoding step multiplies a few rows by every weight, and there the form of the product
# matters on CPU: MKL's fp32 x @ W^T (nn.Linear) is slow for 2-8 rows, W @ x^T is not, and one
# row runs fastest against a transposed copy of the weight. Measured (benchmarks/
# decode_vs_transformers.py's CPU, one thread, the LM head [32000, 512], CPU ms incl. argmax):
#   rows           1     2     4     8
#   x @ W^T      5.8  12.5  20.3  23.0
#   W @ x^T      5.7   9.5   8.7  14.3
#   x @ (W^T)c   3.4   7.3  15.1  19.1   ((W^T)c: the copy, 61 ms to make)
TRANSPOSED_HEAD_MAX_ROWS = 2  # the LM head against its transposed copy up to this many rows ...
TRANSPOSED_HEAD_MIN_STEPS = 64  # ... when this many decoding steps are left to amortise the copy


def _plain_linear(lin: nn.Module) -> bool:
    """An ``nn.Linear`` running ``nn.Linear.forward`` (not a LoRA layer; FSDP2's wrapper class
    keeps the forward) on a plain, not tensor-parallel, weight."""
    return (isinstance(lin, nn.Linear) and type(lin).forward is nn.Linear.forward
            and local_tensor(lin.weight) is lin.weight)


def _plain_fp32_cpu(lin: nn.Module, x: torch.Tensor) -> bool:
    """An ``nn.Linear`` itself (not a subclass such as a LoRA layer: those run their forward),
    fp32 on CPU, outside autocast: the case the product forms above were measured for."""
    return (_plain_linear(lin) and x.device.type == "cpu" and lin.weight.dtype == torch.float32
            and x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"))


def linear(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` for the few rows of a decoding step: W @ x^T for 2+ rows of a plain fp32 CPU
    ``nn.Linear`` (see above); ``F.linear`` for another plain ``nn.Linear`` (no module call: the LM
    head is part of an FSDP2 unit whose hooks must not run here, see :func:`_norm`); else
    ``lin``'s forward (LoRA, tensor-parallel)."""
    rows = x.numel() // x.shape[-1]
    if rows < 2 or not _plain_fp32_cpu(lin, x):
        if _plain_linear(lin):
            return F.linear(x, lin.weight, lin.bias)
        return lin(x)
    y = torch.mm(lin.weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()  # (the next ops want rows)
    if lin.bias is not None:
        y += lin.bias
    return y.view(*x.shape[:-1], y.shape[-1])


def _mlp(m: MLP, x: torch.Tensor) -> torch.Tensor:
    return linear(m.down_proj, m.act_fn(linear(m.up_proj, x)))


def _logits(model, cache: NemotronHCache, h: torch.Tensor) -> torch.Tensor:
    """The LM head of a decoding step, h [b, H] -> fp32 logits [b, V]."""
    head = model.lm_head
    if h.shape[0] <= TRANSPOSED_HEAD_MAX_ROWS and _plain_fp32_cpu(head, h) and head.bias is None:
        if cache.head_t is None and cache.max_length - cache.length >= TRANSPOSED_HEAD_MIN_STEPS:
            cache.head_t = head.weight.t().contiguous()
        if cache.head_t is not None:
            return h @ cache.head_t
    return linear(head, h).float()


# ---------------------------------------------------------------------------------- Mamba2
def _mamba_out(m: Mamba2Mixer, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = m.norm(y.reshape(z.shape), z)
    return m.out_proj(y.to(dtype))


def mamba_prefill(m: Mamba2Mixer, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None,
                  valid: torch.Tensor | None) -> tuple[torch.Tensor, MambaState]:
    """The mixer's forward over the prompt, returning also the conv window and the final state."""
    b, L, _ = hidden_states.shape
    z, xBC, dt = m.project(hidden_states)
    k = m.conv1d.weight.shape[-1]
    window = xBC if valid is None else xBC.masked_fill(~valid[..., None], 0)
    window = window[:, -(k - 1):].transpose(1, 2) if k > 1 else window[:, :0].transpose(1, 2)
    if window.shape[-1] < k - 1:  # a prompt shorter than the window: zeros before it
        window = torch.nn.functional.pad(window, (k - 1 - window.shape[-1], 0))
    xBC = kernels.causal_conv1d(xBC.transpose(1, 2), local_tensor(m.conv1d.weight).squeeze(1),
                                local_tensor(m.conv1d.bias), seq_idx).transpose(1, 2)
    x, B, C = m.split_conv_output(xBC)
    y, ssm = kernels.ssd_scan(
        x, dt, -torch.exp(local_tensor(m.A_log).float()), B, C, chunk_size=m.chunk_size,
        D=local_tensor(m.D), dt_bias=local_tensor(m.dt_bias), dt_limit=m.dt_limit, seq_idx=seq_idx,
        return_final_state=True,
    )
    state = MambaState(conv=window.contiguous(), ssm=ssm.float().contiguous())
    return _mamba_out(m, y, z, hidden_states.dtype), state


def _step_constants(m: Mamba2Mixer, x: torch.Tensor) -> recurrent.StepConstants | None:
    """The mixer's parameters for :func:`recurrent.mixer_step_fp32` when it applies: fp32 on CPU,
    plain (not LoRA, not tensor-parallel) projections, conv and norm."""
    if not (_plain_fp32_cpu(m.in_proj, x) and _plain_linear(m.out_proj) and type(m.norm) is RMSNormGated
            and all(local_tensor(p) is p and p.dtype == torch.float32
                    for p in (m.conv1d.weight, m.A_log, m.D, m.dt_bias, m.norm.weight))
            and m.conv1d.weight.shape[-1] > 1):
        return None
    return recurrent.StepConstants.make(
        m.A_log, m.dt_bias, m.dt_limit, m.D, m.conv1d.weight.squeeze(1), m.conv1d.bias, m.norm.weight,
        m.norm.eps, groups=m.n_groups, head_dim=m.head_dim, n=m.ssm_state_size)


def mamba_step(m: Mamba2Mixer, hidden_states: torch.Tensor, state: MambaState) -> torch.Tensor:
    """One token per row, hidden_states [b, 1, H]; ``state`` is updated in place."""
    if state.step is None:
        state.step = _step_constants(m, hidden_states) or False
    if state.step:  # fp32 CPU: the fused form, its constants made once per generate
        y = recurrent.mixer_step_fp32(linear(m.in_proj, hidden_states[:, 0]), state.conv, state.ssm, state.step)
        return linear(m.out_proj, y)[:, None]
    z, xBC, dt = m.project_output(linear(m.in_proj, hidden_states[:, 0]))
    xBC = kernels.conv_step(xBC, state.conv, local_tensor(m.conv1d.weight).squeeze(1), local_tensor(m.conv1d.bias))
    x, B, C = m.split_conv_output(xBC)
    y = kernels.ssd_step(
        state.ssm, x, dt, -torch.exp(local_tensor(m.A_log).float()), B, C,
        D=local_tensor(m.D), dt_bias=local_tensor(m.dt_bias), dt_limit=m.dt_limit,
    )
    y = m.norm(y.reshape(z.shape), z)
    return linear(m.out_proj, y.to(hidden_states.dtype))[:, None]


# ---------------------------------------------------------------------------------- attention
def _qkv(m: Attention, hidden_states: torch.Tensor):
    """q, k, v [b, heads, L, head_dim] (this rank's heads under tensor parallelism)."""
    b, L, _ = hidden_states.shape
    q, k, v = (linear(p, hidden_states).view(b, L, -1, m.head_dim).transpose(1, 2)
               for p in (m.q_proj, m.k_proj, m.v_proj))
    if m.local_kv_heads is not None:
        k, v = m.local_kv_heads(k), m.local_kv_heads(v)
    return q, k, v


def _attend(m: Attention, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    """One query per row, q [b, heads, 1, d], against the cached k / v [b, kv_heads, t, d]: the
    query heads sharing a kv head are the rows of one attention (no causal mask: every cached
    key precedes the query; ``mask`` [b, 1, 1, t] drops padding). Heads are this rank's under
    tensor parallelism."""
    b, heads = q.shape[:2]
    kv_heads = k.shape[1]
    q = q.reshape(b, kv_heads, heads // kv_heads, m.head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return linear(m.o_proj, out.reshape(b, 1, heads * m.head_dim))


def attention_prefill(m: Attention, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None,
                      max_length: int) -> tuple[torch.Tensor, KVCache]:
    """The prompt's attention (``seq_idx``: padding and prompt as two documents, or None) and
    its key/value cache, with room for ``max_length`` positions."""
    q, k, v = _qkv(m, hidden_states)
    b, kv_heads, L, d = k.shape
    cache = KVCache(*(torch.empty(b, kv_heads, max_length, d, dtype=k.dtype, device=k.device) for _ in range(2)))
    cache.k[:, :, :L] = k
    cache.v[:, :, :L] = v
    out = document_causal_attention(q, k, v, seq_idx)
    return m.o_proj(out.transpose(1, 2).reshape(b, L, -1)), cache


def attention_step(m: Attention, hidden_states: torch.Tensor, cache: KVCache, valid: torch.Tensor | None,
                   t: int) -> torch.Tensor:
    """One token per row at cache position ``t``, attending to the valid positions <= t (all
    of them when ``valid`` is None)."""
    q, k, v = _qkv(m, hidden_states)
    cache.k[:, :, t] = k[:, :, 0]
    cache.v[:, :, t] = v[:, :, 0]
    mask = valid[:, None, None, : t + 1] if valid is not None else None
    return _attend(m, q, cache.k[:, :, : t + 1], cache.v[:, :, : t + 1], mask)


# ---------------------------------------------------------------------------------- MoE
def moe_step(m: MoE, hidden_states: torch.Tensor) -> torch.Tensor:
    """The MoE layer for the few tokens of a decoding step (one per row): only the chosen experts
    run, as in ``MoE.forward``, but the k copies of each token are grouped by expert on the host
    (a few ints) instead of by sort / bincount / scatter kernels."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    _, weights, idx = m.route(x)
    h = m.fc1_latent_proj(x) if m.fc1_latent_proj is not None else x
    T, k = idx.shape
    flat = idx.view(-1).tolist()
    if T == 1 and type(m.experts) is Experts and type(m.token_dispatcher) is LocalDispatcher:
        # one token (batch 1): its k experts one after the other, no grouping at all
        ex = m.experts
        ys = [F.linear(ex.act_fn(F.linear(h, ex.up_proj[e])), ex.down_proj[e]) for e in flat]
        y = (torch.cat(ys).float() * weights[0, :, None].float()).sum(0, keepdim=True).to(hidden_states.dtype)
        if m.fc2_latent_proj is not None:
            y = m.fc2_latent_proj(y)
        return y.view(shape) + _mlp(m.shared_experts, hidden_states)
    order = sorted(range(T * k), key=flat.__getitem__)  # copies grouped by expert (stable)
    counts = [0] * m.experts.num_experts
    for e in flat:
        counts[e] += 1
    # every row of the sorted copies is the one token when T == 1: no gather
    sorted_h = h.expand(k, -1) if T == 1 else h[torch.tensor([i // k for i in order], device=h.device)]
    y_sorted = m.token_dispatcher(m.experts, sorted_h, torch.tensor(counts, device=h.device))
    inverse = [0] * (T * k)
    for pos, i in enumerate(order):
        inverse[i] = pos
    # as moe.unpermute: back to the k copies of each token, gate-weighted sum over them in fp32
    y = y_sorted[torch.tensor(inverse, device=h.device)].view(T, k, -1).float() * weights[:, :, None].float()
    y = y.sum(dim=1).to(hidden_states.dtype)
    if m.fc2_latent_proj is not None:
        y = m.fc2_latent_proj(y)
    return y.view(shape) + _mlp(m.shared_experts, hidden_states)


# ---------------------------------------------------------------------------------- model
def _check_model(model) -> None:
    bb = model.backbone
    if bb.embeddings is None or bb.norm_f is None or model.lm_head is None:
        raise ValueError("generate needs the whole model (embeddings, all layers, norm_f, lm_head); "
                         "a pipeline stage generates with its chain (pipeline=...)")
    if len(bb.layers) != model.config.num_hidden_layers:
        raise ValueError(f"generate needs all {model.config.num_hidden_layers} layers; this model holds "
                         f"{len(bb.layers)}")


def _prompt_mask(shape: tuple[int, int], attention_mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """The attention_mask as bool [b, L], None when it has no padding; ValueError unless it is
    left padding with at least one token per row."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(shape)}: they must match")
    valid = attention_mask.to(device=device).bool()
    if bool(valid.all()):
        return None
    if not bool(valid[:, -1].all()):
        raise ValueError("attention_mask: every prompt needs its last position to be a token (0s only as "
                         "left padding before the prompt; pad on the left, e.g. tokenizer.padding_side='left')")
    if bool((valid[:, 1:] < valid[:, :-1]).any()):
        raise ValueError("attention_mask: padding (0) after a token; batched prompts must be left-padded "
                         "(tokenizer.padding_side='left')")
    return valid


def _embed(model, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids embedded, or (a pipeline stage without the embeddings) hidden states as given."""
    emb = model.backbone.embeddings
    return inputs if emb is None else emb(inputs)


def _head(model, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the last position [b, V]; a stage without the head returns ``h`` [b, L, H]."""
    return h if model.lm_head is None else linear(model.lm_head, h[:, -1]).float()


def _norm(norm: RMSNorm, x: torch.Tensor, decoding: bool) -> torch.Tensor:
    """``norm(x)``; in a decoding step of an fp32 model torch's fused ``rms_norm`` (the same
    function in one kernel instead of six for the one row). A plain (not tensor-parallel) norm
    runs without its module call: the final norm is part of an FSDP2 unit whose hooks must not
    run here (FSDP2 wants a forward through the root first; the caller gathered the weights)."""
    x = x if x.dtype == norm.weight.dtype else x.to(norm.weight.dtype)
    if (not isinstance(norm, RMSNorm) or type(norm).forward is not RMSNorm.forward
            or local_tensor(norm.weight) is not norm.weight):
        return norm(x)
    if decoding and x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
    return norm.normalize(x)


def _run_layers(model, h: torch.Tensor, mamba, attention, decoding: bool = False) -> torch.Tensor:
    """The blocks (pre-norm residual) with the Mamba2 and attention mixers replaced by the cached
    forms ``mamba(name, mixer, x)`` / ``attention(name, mixer, x)``; then norm_f (if held).
    ``decoding``: a step of a few rows (the MoE and MLP layers in their few-row forms too)."""
    for name, block in model.backbone.layers.items():
        x = _norm(block.norm, h, decoding)
        if block.block_type == "linear_attention":
            x = mamba(name, block.mixer, x)
        elif block.block_type == "full_attention":
            x = attention(name, block.mixer, x)
        elif decoding and isinstance(block.mixer, MoE):
            x = moe_step(block.mixer, x)
        elif decoding and isinstance(block.mixer, MLP):
            x = _mlp(block.mixer, x)
        else:
            x = block.mixer(x)
        h = h + x
    return h if model.backbone.norm_f is None else _norm(model.backbone.norm_f, h, decoding)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            max_length: int | None = None, inputs_embeds: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, NemotronHCache]:
    """Run the prompt [b, L] (left-padded where ``attention_mask`` is 0) once. Returns the logits
    [b, V] (fp32) of the last position and the cache, with room for ``max_length`` tokens in all
    (default L). A pipeline stage takes and returns what it holds: hidden states [b, L, H] in
    without the embeddings, out without the head."""
    h = _embed(model, input_ids) if inputs_embeds is None else inputs_embeds
    b, L = h.shape[:2]
    max_length = L if max_length is None else max_length
    assert max_length >= L, (max_length, L)
    valid = _prompt_mask((b, L), attention_mask, h.device)
    seq_idx = None
    if valid is not None:
        seq_idx = valid.to(torch.int32)  # padding: document 0, the prompt: document 1
    cache_valid = torch.zeros(b, max_length, dtype=torch.bool, device=h.device)
    cache_valid[:, :L] = True if valid is None else valid
    cache = NemotronHCache(valid=cache_valid, length=L, padded=valid is not None)

    def mamba(name, m, x):
        y, cache.layers[name] = mamba_prefill(m, x, seq_idx, valid)
        return y

    def attention(name, m, x):
        y, cache.layers[name] = attention_prefill(m, x, seq_idx, max_length)
        return y

    return _head(model, _run_layers(model, h, mamba, attention)), cache


@torch.no_grad()
def decode_step(model, cache: NemotronHCache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row (tokens [b]); returns the next logits [b, V] (fp32). A pipeline
    stage takes hidden states [b, 1, H] without the embeddings, returns them without the head."""
    t = cache.length
    if t >= cache.max_length:
        raise ValueError(f"the cache holds {cache.max_length} tokens and is full; prefill with a larger max_length")
    cache.valid[:, t] = True
    h = _run_layers(
        model, _embed(model, tokens[:, None] if tokens.dim() == 1 else tokens),
        lambda name, m, x: mamba_step(m, x, cache.layers[name]),
        lambda name, m, x: attention_step(m, x, cache.layers[name], cache.valid if cache.padded else None, t),
        decoding=True,
    )
    cache.length = t + 1
    return h if model.lm_head is None else _logits(model, cache, h[:, 0])


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: GenerationConfig,
             pipeline=None, lockstep_group=None) -> torch.Tensor:
    """See ``NemotronHForCausalLM.generate``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if pipeline is None:
        _check_model(model)
        models = [model]
    else:
        models = pipeline.stages
    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        max_length = input_ids.shape[1] + config.max_new_tokens
        if pipeline is None:
            cache: list[NemotronHCache] = []

            def first():
                logits, c = prefill(model, input_ids, attention_mask, max_length=max_length)
                cache.append(c)
                return logits

            def run():
                return decode(first, lambda tok: decode_step(model, cache[0], tok), input_ids,
                              config, lockstep_group=lockstep_group)
        else:
            caches: dict[int, NemotronHCache] = {}

            def stage_prefill(i, stage, x):
                out, caches[i] = prefill(stage, x, attention_mask, max_length=max_length)
                return out

            def run():
                return decode(lambda: pipeline.run(stage_prefill, input_ids),
                              lambda tok: pipeline.run(lambda i, stage, x: decode_step(stage, caches[i], x), tok),
                              input_ids, config, share_tokens=pipeline.share_tokens,
                              lockstep_group=lockstep_group)
        # inference mode: no version counters or views tracking for the step's few hundred
        # small ops (batch 1: 8 % less CPU time per step); the tokens leave it as a plain tensor
        with torch.inference_mode():
            out = run()
        return out.clone()
    finally:
        for m, t in zip(models, was_training):
            m.train(t)
