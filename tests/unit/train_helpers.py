"""Shared pieces of the training-loop tests: a tiny model, a synthetic dataset, a trainer."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from hybridtrain.training.checkpoint import Checkpointer
from hybridtrain.training.lr_schedule import LRScheduler
from hybridtrain.training.metrics import MetricsLogger
from hybridtrain.training.optim import build_optimizer
from hybridtrain.training.step_scheduler import StepScheduler
from hybridtrain.training.trainer import Trainer, TrainStep

VOCAB = 48


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
    """Stand-in with the model API the trainer uses (hidden_states, lm_head, config)."""

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embeddings = torch.nn.Embedding(config.vocab_size, h)
        self.layers = torch.nn.ModuleList(_Block(h) for _ in range(config.num_layers))
        self.norm_f = torch.nn.RMSNorm(h)
        self.lm_head = torch.nn.Linear(h, config.vocab_size, bias=False)

    def hidden_states(self, input_ids, position_ids=None, cu_seqlens=None):
        x = self.embeddings(input_ids)
        x = x + torch.cumsum(x, dim=1) / torch.arange(1, x.shape[1] + 1)[:, None]  # causal mix
        for layer in self.layers:
            x = layer(x)
        return self.norm_f(x)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, labels=None):
        return self.lm_head(self.hidden_states(input_ids, position_ids, cu_seqlens))

    def save_pretrained(self, out_dir, state_dict=None):
        import json
        import os

        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        sd = state_dict if state_dict is not None else self.state_dict()
        save_file({k: v.contiguous() for k, v in sd.items()},
                  os.path.join(out_dir, "model.safetensors"))
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(self.config.to_dict(), f)


def standin_model(seed: int = 0):
    torch.manual_seed(seed)
    return TinyLM(TinyConfig())


def tiny_model(seed: int = 0):
    """The tiny Nemotron-H with all four layer types (Mamba, attention, MLP, MoE)."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM, tiny_config

    torch.manual_seed(seed)
    return NemotronHForCausalLM(tiny_config("mixed", vocab_size=VOCAB, hidden_size=32,
                                            intermediate_size=64, moe_intermediate_size=16,
                                            moe_shared_expert_intermediate_size=16,
                                            mamba_num_heads=4, n_routed_experts=4))


class SyntheticDataset(torch.utils.data.Dataset):
    """Sequences of uneven length with uneven label counts (labels already shifted)."""

    def __init__(self, n: int = 64, max_len: int = 12, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(4, max_len + 1, (), generator=g))
            ids = torch.randint(1, VOCAB, (length,), generator=g)
            prompt = int(torch.randint(1, length - 1, (), generator=g))
            labels = torch.full((length,), -100)
            labels[prompt - 1 : length - 1] = ids[prompt:]
            self.items.append({"input_ids": ids, "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(items):
    n = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    labels = torch.full((len(items), n), -100, dtype=torch.long)
    mask = torch.zeros(len(items), n, dtype=torch.long)
    for r, it in enumerate(items):
        k = len(it["input_ids"])
        ids[r, :k], labels[r, :k], mask[r, :k] = it["input_ids"], it["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def make_loader(dataset, batch_sampler):
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate,
                      generator=torch.Generator())


def build_trainer(out_dir, max_steps=8, gbs=8, mbs=2, ckpt_every=4, lr=3e-3, seed=0,
                  model_fn=tiny_model, train_step=None, val=True, keep_last=None,
                  log_every=1, save_hf_at_end=False, n_train=64):
    torch.manual_seed(seed)
    model = model_fn(seed)
    opt = build_optimizer(model, lr=lr, weight_decay=0.1)
    sched = StepScheduler(gbs, mbs, max_steps=max_steps, num_train_samples=n_train,
                          ckpt_every_steps=ckpt_every, val_every_steps=4,
                          log_every_steps=log_every, seed=seed)
    lrs = LRScheduler(opt, lr_decay_style="cosine", lr_warmup_steps=2, total_steps=max_steps,
                      min_lr=lr / 10)
    ckpt = Checkpointer(out_dir, keep_last=keep_last) if out_dir else None
    metrics = MetricsLogger(out_dir, progress=False, plot=False) if out_dir else None
    return Trainer(
        model, opt, lrs, sched, SyntheticDataset(n_train), make_loader,
        val_dataset=SyntheticDataset(10, seed=1) if val else None, checkpointer=ckpt,
        metrics=metrics, train_step=train_step or TrainStep(chunk_size=16),
        save_hf_at_end=save_hf_at_end,
    )
