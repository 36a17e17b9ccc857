"""A plain dense decoder (RMSNorm, grouped-query attention with RoPE, SwiGLU MLP), registered
as the model spec ``dense_test`` from the test suite alone: the second model family that proves
the generic packages reach a model only through its spec. Parameter names follow the Llama
layout of the Hub (``model.embed_tokens``, ``model.layers.<i>.self_attn.q_proj``, ...)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from hybridtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from hybridtrain.distributed.fsdp import apply_fsdp
from hybridtrain.models.spec import (FlopsCount, HFAdapter, MemoryPlanSupport, MetaInit,
                                     ModelSpec, PeftSupport, PipelineSplit, register_model_spec)
from hybridtrain.ops.loss import LinearCrossEntropy


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
    model_type: str = "dense_test"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> "DenseConfig":
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

    def save_pretrained(self, out_dir, state_dict=None, dtype=None, **_):
        save_hf(self.state_dict() if state_dict is None else state_dict, self.config, out_dir,
                dtype=dtype)

    @classmethod
    def from_pretrained(cls, local_dir, dtype=None, device=None):
        with open(os.path.join(local_dir, "config.json")) as f:
            model = cls(DenseConfig.from_dict(json.load(f)))
        model.load_state_dict(load_file(os.path.join(local_dir, "model.safetensors")))
        return model.to(dtype=dtype) if dtype is not None else model


def save_hf(state_dict, config, out_dir, max_shard_size=None, dtype=None, tensors=None):
    """config.json and one model.safetensors (``tensors``: the full tensors streamed as
    ``(name, tensor)`` pairs instead of ``state_dict``'s)."""
    pairs = tensors if tensors is not None else state_dict.items()
    out = {n: (t.to(dtype) if dtype is not None else t).detach().cpu().contiguous()
           for n, t in pairs}
    os.makedirs(out_dir, exist_ok=True)
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)


def fsdp_units(model) -> tuple[list, list]:
    """(the FSDP2 units: each decoder layer, no expert units); the root holds the rest."""
    return list(model.model.layers.values()), []


def parallelize(model, dims, distributed, training, *, device, autocast_dtype):
    if dims.tp > 1 or dims.cp > 1 or dims.ep > 1:
        raise ValueError("dense_test supports data and pipeline parallelism only")
    if training.activation_checkpointing:  # no LayerTypes part: all or every k-th block only
        apply_activation_checkpointing(model.model.layers, training.activation_checkpointing)
    if dims.fsdp_enabled:
        units, _ = fsdp_units(model)
        apply_fsdp(model, units, dims, distributed, autocast_dtype=autocast_dtype)


def layer_flops(c: DenseConfig, seq_len: int) -> list[float]:
    H, kv = c.hidden_size, c.hidden_size // c.num_attention_heads * c.num_key_value_heads
    per = 2 * (2 * H * H + 2 * H * kv + 3 * H * c.intermediate_size) + 4 * seq_len * H
    return [float(per)] * c.num_hidden_layers


def batch_flops(c: DenseConfig, batch: dict, head_on_label_tokens_only: bool) -> float:
    tokens = batch["input_ids"].numel()
    return 3.0 * tokens * (sum(layer_flops(c, batch["input_ids"].shape[1]))
                           + 2 * c.hidden_size * c.vocab_size)


DENSE = register_model_spec(ModelSpec(
    name="dense_test", model_cls=DenseLM, config_cls=DenseConfig, parallelize_fn=parallelize,
    pipeline=PipelineSplit(
        layers=lambda m: list(m.model.layers.keys()),
        stage=lambda m, layers, first, last: m.pipeline_stage(layers, first, last),
        is_complete=lambda m: (len(m.model.layers) == m.config.num_hidden_layers
                               and m.lm_head is not None and m.model.embed_tokens is not None)),
    flops=FlopsCount(layer=layer_flops, head=lambda c: 2.0 * c.hidden_size * c.vocab_size,
                     batch=batch_flops),
    hf=HFAdapter(save=save_hf),
    parts=(MetaInit(init_units=DenseLM.init_units),
           PeftSupport(module_prefixes={"model.": "model."}),
           MemoryPlanSupport(fsdp_units=fsdp_units)),  # no activation estimate: the plan shows 0
))
