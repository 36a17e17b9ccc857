"""The decoding state of a Nemotron-H model, static for the whole generation: per Mamba2 layer its
conv window and SSM state (fixed size: memory does not grow with the generated length), per
attention layer a key/value cache allocated once for ``max_length`` positions, which cached
positions are real tokens (left padding of batched prompts is not; positions not written yet are
not), and the position of the next token as a device tensor. A decoding step updates all of it
in place and changes no shape, so it can run as one captured CUDA graph (``generation``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MambaState:
    conv: torch.Tensor  # [b, conv_dim, k - 1]: the last k - 1 conv inputs (zeros before the prompt)
    ssm: torch.Tensor  # [b, h, p, n] fp32: the SSM state after the last token
    # the mixer's parameters as the fused fp32 CPU step reads them (mamba_step.StepConstants),
    # made at prefill where ops.backend chooses that step; None: the generic step
    step: object | None = None


@dataclass
class KVCache:
    k: torch.Tensor  # [b, kv_heads, max_length, head_dim]
    v: torch.Tensor


@dataclass
class NemotronHCache:
    """State of every layer after ``length`` tokens. ``valid`` [b, max_length] marks the cached
    positions that are tokens (False: left padding, or not written yet); ``position`` [1] (int64,
    on the device) is where the next token goes: a step writes there and advances it, so a
    replayed step needs no host input. ``length`` is the host's count of the same."""

    valid: torch.Tensor
    position: torch.Tensor
    length: int = 0
    layers: dict[str, MambaState | KVCache] = field(default_factory=dict)
    head_t: torch.Tensor | None = None  # the LM head's weight transposed (ops.backend.transposed_head)

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]

    def select(self, rows: torch.Tensor) -> "NemotronHCache":
        """A new cache whose row ``i`` is a copy of this cache's row ``rows[i]`` (to continue one
        prompt several ways, each from its own copy of the prompt's state)."""
        layers = {name: MambaState(s.conv.index_select(0, rows), s.ssm.index_select(0, rows), s.step)
                  if isinstance(s, MambaState)
                  else KVCache(s.k.index_select(0, rows), s.v.index_select(0, rows))
                  for name, s in self.layers.items()}
        return NemotronHCache(valid=self.valid.index_select(0, rows), position=self.position.clone(),
                              length=self.length, layers=layers, head_t=self.head_t)

    def head(self, rows: int) -> "NemotronHCache":
        """The first ``rows`` rows as views: a step on it updates them in this cache."""
        layers = {name: MambaState(s.conv[:rows], s.ssm[:rows], s.step) if isinstance(s, MambaState)
                  else KVCache(s.k[:rows], s.v[:rows]) for name, s in self.layers.items()}
        return NemotronHCache(valid=self.valid[:rows], position=self.position, length=self.length,
                              layers=layers, head_t=self.head_t)

    def mutable_tensors(self) -> list[torch.Tensor]:
        """What a step changes in place besides the key/value slots at ``position`` (those are
        rewritten by the next step at the same position): to snapshot and restore around the
        warm-up of a CUDA graph capture."""
        out = [self.valid, self.position]
        for s in self.layers.values():
            if isinstance(s, MambaState):
                out += [s.conv, s.ssm]
        return out


def cache_bytes(config, batch_size: int, max_length: int, dtype: torch.dtype) -> int:
    """Bytes of the decoding state ``prefill`` allocates for ``batch_size`` rows and
    ``max_length`` positions with activations in ``dtype`` (known before allocating it): the
    key/value cache of each attention layer, the conv window (``dtype``) and fp32 SSM state of
    each Mamba2 layer, the ``valid`` mask, and the LM head's transposed fp32 copy (an upper
    bound: made only where ``ops.backend`` chooses it)."""
    e = torch.empty((), dtype=dtype).element_size()
    b, c = batch_size, config
    total = b * max_length  # valid (bool)
    for kind in c.layers_block_type:
        if kind == "full_attention":
            total += 2 * b * c.num_key_value_heads * max_length * c.head_dim * e
        elif kind == "linear_attention":
            total += b * c.mamba_conv_dim * (c.conv_kernel - 1) * e
            total += b * c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size * 4
    return total + c.vocab_size * c.hidden_size * 4
