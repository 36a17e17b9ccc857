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

from collections.abc import Sequence

import torch

from hybridtrain.ops.attention import document_causal_attention
from hybridtrain.ops.sampling import decode

from . import kernels
from .attention import Attention
from .cache import KVCache, MambaState, NemotronHCache
from .mamba2 import Mamba2Mixer


# ---------------------------------------------------------------------------------- Mamba2
def _mamba_out(m: Mamba2Mixer, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = m.norm(y.reshape(*z.shape[:-1], m.intermediate_size), z)
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
    xBC = kernels.causal_conv1d(xBC.transpose(1, 2), m.conv1d.weight.squeeze(1), m.conv1d.bias, seq_idx).transpose(1, 2)
    x, B, C = m.split_conv_output(xBC)
    y, ssm = kernels.ssd_scan(
        x.reshape(b, L, m.num_heads, m.head_dim), dt, -torch.exp(m.A_log.float()),
        B.reshape(b, L, m.n_groups, m.ssm_state_size), C.reshape(b, L, m.n_groups, m.ssm_state_size),
        chunk_size=m.chunk_size, D=m.D, dt_bias=m.dt_bias, dt_limit=m.dt_limit, seq_idx=seq_idx,
        return_final_state=True,
    )
    state = MambaState(conv=window.contiguous(), ssm=ssm.float().contiguous())
    return _mamba_out(m, y, z, hidden_states.dtype), state


def mamba_step(m: Mamba2Mixer, hidden_states: torch.Tensor, state: MambaState) -> torch.Tensor:
    """One token per row, hidden_states [b, 1, H]; ``state`` is updated in place."""
    b = hidden_states.shape[0]
    z, xBC, dt = m.project(hidden_states[:, 0])
    xBC = kernels.conv_step(xBC, state.conv, m.conv1d.weight.squeeze(1), m.conv1d.bias)
    x, B, C = m.split_conv_output(xBC)
    y = kernels.ssd_step(
        state.ssm, x.reshape(b, m.num_heads, m.head_dim), dt, -torch.exp(m.A_log.float()),
        B.reshape(b, m.n_groups, m.ssm_state_size), C.reshape(b, m.n_groups, m.ssm_state_size),
        D=m.D, dt_bias=m.dt_bias, dt_limit=m.dt_limit,
    )
    return _mamba_out(m, y, z, hidden_states.dtype)[:, None]


# ---------------------------------------------------------------------------------- attention
def _qkv(m: Attention, hidden_states: torch.Tensor):
    b, L, _ = hidden_states.shape
    q = m.q_proj(hidden_states).view(b, L, m.num_heads, m.head_dim).transpose(1, 2)
    k = m.k_proj(hidden_states).view(b, L, m.num_kv_heads, m.head_dim).transpose(1, 2)
    v = m.v_proj(hidden_states).view(b, L, m.num_kv_heads, m.head_dim).transpose(1, 2)
    return q, k, v


def _attend(m: Attention, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    b, _, L, _ = q.shape
    gqa = m.num_kv_heads != m.num_heads
    if mask is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=L > 1, enable_gqa=gqa)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return m.o_proj(out.transpose(1, 2).reshape(b, L, m.num_heads * m.head_dim))


def attention_prefill(m: Attention, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None,
                      cache: KVCache) -> torch.Tensor:
    """The prompt's attention (``seq_idx``: padding and prompt as two documents, or None)."""
    q, k, v = _qkv(m, hidden_states)
    L = k.shape[2]
    cache.k[:, :, :L] = k
    cache.v[:, :, :L] = v
    out = document_causal_attention(q, k, v, seq_idx)
    return m.o_proj(out.transpose(1, 2).reshape(q.shape[0], L, m.num_heads * m.head_dim))


def attention_step(m: Attention, hidden_states: torch.Tensor, cache: KVCache, valid: torch.Tensor | None,
                   t: int) -> torch.Tensor:
    """One token per row at cache position ``t``, attending to the valid positions <= t (all
    of them when ``valid`` is None)."""
    q, k, v = _qkv(m, hidden_states)
    cache.k[:, :, t] = k[:, :, 0]
    cache.v[:, :, t] = v[:, :, 0]
    mask = valid[:, None, None, : t + 1] if valid is not None else None
    return _attend(m, q, cache.k[:, :, : t + 1], cache.v[:, :, : t + 1], mask)


# ---------------------------------------------------------------------------------- model
def _check_model(model) -> None:
    bb = model.backbone
    if bb.embeddings is None or bb.norm_f is None or model.lm_head is None:
        raise ValueError("generate needs the whole model (embeddings, all layers, norm_f, lm_head), "
                         "not a pipeline stage")
    if len(bb.layers) != model.config.num_hidden_layers:
        raise ValueError(f"generate needs all {model.config.num_hidden_layers} layers; this model holds "
                         f"{len(bb.layers)}")


def _prompt_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The attention_mask as bool [b, L], None when it has no padding; ValueError unless it is
    left padding with at least one token per row."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}: they must match")
    valid = attention_mask.to(device=input_ids.device).bool()
    if bool(valid.all()):
        return None
    if not bool(valid[:, -1].all()):
        raise ValueError("attention_mask: every prompt needs its last position to be a token (0s only as "
                         "left padding before the prompt; pad on the left, e.g. tokenizer.padding_side='left')")
    if bool((valid[:, 1:] < valid[:, :-1]).any()):
        raise ValueError("attention_mask: padding (0) after a token; batched prompts must be left-padded "
                         "(tokenizer.padding_side='left')")
    return valid


def _run_layers(model, h: torch.Tensor, mamba, attention) -> torch.Tensor:
    """The blocks (pre-norm residual) with the Mamba2 and attention mixers replaced by the cached
    forms ``mamba(name, mixer, x)`` / ``attention(name, mixer, x)``; then norm_f."""
    for name, block in model.backbone.layers.items():
        x = block.norm(h.to(block.norm.weight.dtype))
        if block.block_type == "linear_attention":
            x = mamba(name, block.mixer, x)
        elif block.block_type == "full_attention":
            x = attention(name, block.mixer, x)
        else:
            x = block.mixer(x)
        h = h + x
    return model.backbone.norm_f(h)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            max_length: int | None = None, inputs_embeds: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, NemotronHCache]:
    """Run the prompt [b, L] (left-padded where ``attention_mask`` is 0) once. Returns the logits
    [b, V] (fp32) of the last position and the cache, with room for ``max_length`` tokens in all
    (default L)."""
    _check_model(model)
    ids = input_ids if inputs_embeds is None else inputs_embeds[..., 0]
    b, L = ids.shape[:2]
    max_length = L if max_length is None else max_length
    assert max_length >= L, (max_length, L)
    valid = _prompt_mask(ids, attention_mask)
    h = model.backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
    dev = h.device
    seq_idx = None
    if valid is not None:
        seq_idx = valid.to(torch.int32)  # padding: document 0, the prompt: document 1
    cache_valid = torch.zeros(b, max_length, dtype=torch.bool, device=dev)
    cache_valid[:, :L] = True if valid is None else valid
    cache = NemotronHCache(valid=cache_valid, length=L, padded=valid is not None)
    dtype = model.lm_head.weight.dtype if not torch.is_autocast_enabled(dev.type) \
        else torch.get_autocast_dtype(dev.type)

    def mamba(name, m, x):
        y, cache.layers[name] = mamba_prefill(m, x, seq_idx, valid)
        return y

    def attention(name, m, x):
        kv = KVCache(*(torch.empty(b, m.num_kv_heads, max_length, m.head_dim, dtype=dtype, device=dev)
                       for _ in range(2)))
        cache.layers[name] = kv
        return attention_prefill(m, x, seq_idx, kv)

    h = _run_layers(model, h, mamba, attention)
    return model.lm_head(h[:, -1]).float(), cache


@torch.no_grad()
def decode_step(model, cache: NemotronHCache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row (tokens [b]); returns the next logits [b, V] (fp32)."""
    t = cache.length
    if t >= cache.max_length:
        raise ValueError(f"the cache holds {cache.max_length} tokens and is full; prefill with a larger max_length")
    cache.valid[:, t] = True
    h = model.backbone.embeddings(tokens[:, None])
    h = _run_layers(
        model, h,
        lambda name, m, x: mamba_step(m, x, cache.layers[name]),
        lambda name, m, x: attention_step(m, x, cache.layers[name], cache.valid if cache.padded else None, t),
    )
    cache.length = t + 1
    return model.lm_head(h[:, 0]).float()


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """See ``NemotronHForCausalLM.generate``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    was_training = model.training
    model.eval()
    try:
        cache: list[NemotronHCache] = []

        def first():
            logits, c = prefill(model, input_ids, attention_mask, max_length=input_ids.shape[1] + max_new_tokens)
            cache.append(c)
            return logits

        return decode(first, lambda tok: decode_step(model, cache[0], tok), input_ids, max_new_tokens,
                      do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                      eos_token_id=eos_token_id, seed=seed)
    finally:
        model.train(was_training)
