"""The tiny models of the tests: the tiny Nemotron-H with all four layer types, a small
stand-in that keeps the model contract (``hybridtrain.models.spec``), perturbed weights."""

from __future__ import annotations

import torch

from hybridtrain.ops.loss import LinearCrossEntropy

from .data import VOCAB

# the tiny 'mixed' Nemotron-H (Mamba, attention, MLP, MoE) at the test vocabulary
TINY_MIXED = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=16, mamba_num_heads=4, n_routed_experts=4)


def tiny_model(seed: int = 0, kind: str = "mixed"):
    """The tiny Nemotron-H (``kind`` 'mixed': Mamba, attention, MLP and MoE layers)."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    torch.manual_seed(seed)
    return NemotronHForCausalLM(tiny_config(kind, **TINY_MIXED))


def tiny_base(path) -> None:
    """A tiny 'mixed' Nemotron-H base model folder: weights, config and a byte-level BPE
    tokenizer (ChatML template) built from the synthetic SQuAD world's texts."""
    from hybridtrain.data import build_bpe_tokenizer, synthetic_texts
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    build_bpe_tokenizer(synthetic_texts(200, seed=0), out_dir=path, vocab_size=512)
    torch.manual_seed(0)
    NemotronHForCausalLM(tiny_config("mixed", vocab_size=512)).save_pretrained(path)


def perturbed_model(cfg, seed: int = 0, scale: float = 0.05):
    """Reference init plus noise on every parameter and buffer (norm weights, D, biases,
    e_score_correction_bias all away from their trivial init values)."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM

    torch.manual_seed(seed)
    m = NemotronHForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale)
        for b in m.buffers():
            b.add_(torch.randn_like(b) * scale)
    return m.eval()


class TinyConfig:
    def __init__(self, vocab_size=VOCAB, hidden_size=16, num_layers=2):
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers

    def to_dict(self):
        return dict(vars(self))


class _Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = torch.nn.RMSNorm(h)
        self.mixer = torch.nn.Linear(h, h)
        self.A_log = torch.nn.Parameter(torch.zeros(h))

    def forward(self, x):
        return x + torch.tanh(self.mixer(self.norm(x))) * torch.exp(self.A_log)


class TinyLM(torch.nn.Module):
    """A small stand-in keeping the model contract the trainer uses: ``forward(input_ids,
    position_ids=, cu_seqlens=, labels=)`` (logits, or with ``labels`` ``self.loss(hidden,
    lm_head, labels)``), ``config``, ``save_pretrained`` (models/spec.py: ``CausalLM``)."""

    name_or_path: str | None = None
    checkpoint_dtype: torch.dtype | None = None

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embeddings = torch.nn.Embedding(config.vocab_size, h)
        self.layers = torch.nn.ModuleList(_Block(h) for _ in range(config.num_layers))
        self.norm_f = torch.nn.RMSNorm(h)
        self.lm_head = torch.nn.Linear(h, config.vocab_size, bias=False)
        self.loss = LinearCrossEntropy(reduction="mean")

    def hidden_states(self, input_ids, position_ids=None, cu_seqlens=None):
        x = self.embeddings(input_ids)
        x = x + torch.cumsum(x, dim=1) / torch.arange(1, x.shape[1] + 1)[:, None]  # causal mix
        for layer in self.layers:
            x = layer(x)
        return self.norm_f(x)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, labels=None):
        h = self.hidden_states(input_ids, position_ids, cu_seqlens)
        if labels is None:
            return self.lm_head(h)
        return self.loss(h, self.lm_head, labels)

    def save_pretrained(self, out_dir, *, dtype=None, state_dict=None):
        import json
        import os

        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        sd = state_dict if state_dict is not None else self.state_dict()
        save_file({k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in sd.items()},
                  os.path.join(out_dir, "model.safetensors"))
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(self.config.to_dict(), f)


def standin_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(TinyConfig())


# what the recorded_* recipe targets built, in order (tests of what runs before what)
BUILD_EVENTS: list[str] = []


def recorded_tokenizer(path: str):
    """``load_tokenizer`` as a recipe target that records its call in :data:`BUILD_EVENTS`."""
    from hybridtrain.data import load_tokenizer

    BUILD_EVENTS.append("tokenizer")
    return load_tokenizer(path)


def recorded_model(vocab_size: int):
    """The tiny Nemotron-H as a recipe target that records its build in :data:`BUILD_EVENTS`."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    BUILD_EVENTS.append("model")
    return NemotronHForCausalLM(tiny_config("mixed", **{**TINY_MIXED, "vocab_size": vocab_size}))


def tiny_mamba_mixer(heads: int = 4, groups: int = 1, seed: int = 0):
    """One Mamba2 mixer of 4-wide heads (state 8, chunk 4) with perturbed parameters: ``heads``
    of 4 and ``groups`` of state 8 (``heads * 4 + 2 * groups * 8`` conv channels; the kernels'
    channel-last layout needs a multiple of 8)."""
    from hybridtrain.models.nemotron_h import tiny_config
    from hybridtrain.models.nemotron_h.mamba2 import Mamba2Mixer

    torch.manual_seed(seed)
    cfg = tiny_config("mixed", hidden_size=16, mamba_num_heads=heads, mamba_head_dim=4, ssm_state_size=8,
                      n_groups=groups, chunk_size=4)
    m = Mamba2Mixer(cfg, 0)
    m.reset_parameters()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m
