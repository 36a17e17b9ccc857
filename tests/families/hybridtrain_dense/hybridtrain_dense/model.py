"""The dense decoder and its config, written to the model contract of
``hybridtrain.models.spec`` (``CausalLM``, ``ModelConfig``, ``Decoder``)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from hybridtrain.ops.loss import LinearCrossEntropy
from hybridtrain.ops.sampling import GenerationConfig, decode


@dataclass
class DenseConfig:
    vocab_size: int = 256
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    model_type: ClassVar[str] = "dense_test"

    @property
    def context_length(self) -> None:
        """No limit (rotary positions)."""
        return None

    def to_dict(self) -> dict:
        return {**asdict(self), "model_type": self.model_type}

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "DenseConfig":
        if d.get("model_type", cls.model_type) != cls.model_type:
            raise ValueError(f"{source}: model_type is {d['model_type']!r}, expected "
                             f"{cls.model_type!r}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x, pos, theta):
    """Rotary embedding of ``x`` [B, heads, L, d] at positions ``pos`` [B, L]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = pos[:, None, :, None].float() * inv
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: DenseConfig):
        super().__init__()
        self.h, self.kv, self.d = (c.num_attention_heads, c.num_key_value_heads,
                                   c.hidden_size // c.num_attention_heads)
        self.theta = c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)

    def forward(self, x, pos, mask):
        B, L, _ = x.shape
        q = _rope(self.q_proj(x).view(B, L, self.h, self.d).transpose(1, 2), pos, self.theta)
        k = _rope(self.k_proj(x).view(B, L, self.kv, self.d).transpose(1, 2), pos, self.theta)
        v = self.v_proj(x).view(B, L, self.kv, self.d).transpose(1, 2)
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, c: DenseConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DenseConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, pos, mask):
        x = x + self.self_attn(self.input_layernorm(x), pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseLM(nn.Module):
    """``forward(input_ids, position_ids=None, cu_seqlens=None, labels=None)`` per the model
    contract; a pipeline stage holds some layers, the embeddings only when first and the final
    norm and head only when last (the others are None)."""

    name_or_path: str | None = None  # the folder from_pretrained read
    checkpoint_dtype: torch.dtype | None = None  # the dtype it stored

    def __init__(self, config: DenseConfig, layer_ids=None):
        super().__init__()
        self.config = c = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        ids = range(c.num_hidden_layers) if layer_ids is None else layer_ids
        self.model.layers = nn.ModuleDict({str(i): Layer(c) for i in ids})
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.loss = LinearCrossEntropy(reduction="mean")
        if not self.lm_head.weight.is_meta:
            for name, init in self.init_units():
                init(self.get_submodule(name))

    def init_units(self):
        std = self.config.initializer_range

        def normal(m):
            for p in m.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=std)
                else:
                    nn.init.ones_(p)
        units = [("model.embed_tokens", normal)] if self.model.embed_tokens is not None else []
        units += [(f"model.layers.{k}", normal) for k in self.model.layers]
        if self.lm_head is not None:
            units += [("model.norm", normal), ("lm_head", normal)]
        return units

    def pipeline_stage(self, layers, is_first, is_last):
        with torch.device("meta"):
            stage = type(self)(self.config, layer_ids=())
        stage.model.layers = nn.ModuleDict({k: self.model.layers[k] for k in layers})
        stage.model.embed_tokens = self.model.embed_tokens if is_first else None
        stage.model.norm = self.model.norm if is_last else None
        stage.lm_head = self.lm_head if is_last else None
        stage.loss = self.loss
        return stage

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, labels=None):
        emb = self.model.embed_tokens
        h = emb(input_ids) if emb is not None else input_ids
        B, L = h.shape[:2]
        pos = (position_ids if position_ids is not None
               else torch.arange(L, device=h.device).expand(B, L))
        doc = torch.cumsum((pos == 0).int(), 1)  # a document starts at position 0
        causal = torch.ones(L, L, dtype=torch.bool, device=h.device).tril()
        mask = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]
        for layer in self.model.layers.values():
            h = layer(h, pos, mask)
        if self.lm_head is None:
            return h
        h = self.model.norm(h)
        if labels is None:
            return self.lm_head(h).float()
        return self.loss(h, self.lm_head, labels)

    def generation_cache_bytes(self, batch_size, max_length):
        """No decoding state: every step runs the whole sequence again."""
        return 0

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, *, pipeline=None, lockstep_group=None,
                 **settings):
        """Decoding without a cache (each step runs the whole sequence again): the prompt
        [B, L] (left-padded where ``attention_mask`` is 0) and up to ``max_new_tokens`` new
        tokens; ``lockstep_group``: ranks that step together until all are done. Not through
        pipeline stages (its spec's Decoding part says so)."""
        assert pipeline is None, "dense_test does not decode through pipeline stages"
        config = GenerationConfig(**settings)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        seq = [input_ids]

        def logits():
            ids = torch.cat(seq, 1)
            m = torch.cat([mask, mask.new_ones(ids.shape[0], ids.shape[1] - mask.shape[1])], 1)
            pos = (m.cumsum(1) - 1).clamp(min=0)  # left padding: each pad token its own document
            return self(ids, position_ids=pos)[:, -1]

        def step(tokens):
            seq.append(tokens[:, None])
            return logits()

        was_training = self.training
        self.eval()
        try:
            return decode(logits, step, input_ids, config, lockstep_group=lockstep_group)
        finally:
            self.train(was_training)

    def save_pretrained(self, save_dir, *, dtype=None, state_dict=None):
        save_hf(self.state_dict() if state_dict is None else state_dict, self.config, save_dir,
                dtype=dtype)

    @classmethod
    def from_pretrained(cls, local_dir, dtype=None, device=None):
        path = os.path.join(local_dir, "config.json")
        with open(path) as f:
            config = DenseConfig.from_dict(json.load(f), source=path)
        tensors = load_file(os.path.join(local_dir, "model.safetensors"))
        model = cls(config)  # in full on any device (no MetaInit.hf_slice_reader)
        model.load_state_dict(tensors)
        model.name_or_path = str(local_dir)
        model.checkpoint_dtype = next(iter(tensors.values())).dtype
        return model.to(dtype=dtype) if dtype is not None else model


def save_hf(state_dict, config, out_dir, *, dtype=None, max_shard_size=None, tensors=None):
    """config.json and one model.safetensors (``tensors``: the full tensors streamed as
    ``(name, tensor)`` pairs instead of ``state_dict``'s; one file whatever
    ``max_shard_size``)."""
    pairs = tensors if tensors is not None else state_dict.items()
    out = {n: (t.to(dtype) if dtype is not None else t).detach().cpu().contiguous()
           for n, t in pairs}
    os.makedirs(out_dir, exist_ok=True)
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
