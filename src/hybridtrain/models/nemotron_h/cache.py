"""The decoding state of a Nemotron-H model: per Mamba2 layer its conv window and SSM state (fixed
size: memory does not grow with the generated length), per attention layer a key/value cache
allocated once for the whole generation, and which cached positions are real tokens (left
padding of batched prompts is not)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MambaState:
    conv: torch.Tensor  # [b, conv_dim, k - 1]: the last k - 1 conv inputs (zeros before the prompt)
    ssm: torch.Tensor  # [b, h, p, n] fp32: the SSM state after the last token
    step: object | None = None  # the mixer's parameters as the fp32 CPU step reads them (recurrent.StepConstants)


@dataclass
class KVCache:
    k: torch.Tensor  # [b, kv_heads, max_length, head_dim]
    v: torch.Tensor


@dataclass
class NemotronHCache:
    """State of every layer after ``length`` tokens; ``valid`` [b, max_length] marks the cached
    positions that are tokens (False: left padding, or not written yet)."""

    valid: torch.Tensor
    length: int = 0
    padded: bool = False  # some prompt was left-padded: attention masks the invalid positions
    layers: dict[str, MambaState | KVCache] = field(default_factory=dict)
    head_t: torch.Tensor | None = None  # the LM head's weight transposed (CPU decoding; generation._logits)

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]
