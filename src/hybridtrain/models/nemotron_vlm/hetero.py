"""Heterogeneous layout of the vision-language model: the vision encoder + projector on ranks
``0..E-1`` (data-parallel among themselves), the language model on the others (one lane per
rank), joined by :mod:`hybridtrain.distributed.bridge`.

Per micro-batch a language lane sends its images (``image_grid`` + ``pixel_values``, split in
contiguous shares when several encoder ranks serve it) to its encoder rank(s), receives the
projected embeddings ``[tokens, hidden]`` (a leaf that requires grad), scatters them into its
placeholders, runs the language model and back-propagates ``loss_sum / global label tokens``,
then returns each encoder rank the gradient of its share. Encoder ranks back-propagate that
gradient through projector and ViT. Gradients are then summed inside each rank set, so both
modules hold exactly the one-process gradient of the per-token mean loss.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hybridtrain.distributed.bridge import (
    BridgeLayout,
    all_reduce_grads,
    recv_2d,
    send_2d,
    split_shares,
)

ENCODER_MODULES = ("vision_model", "projector")
LANGUAGE_MODULES = ("language_model",)


class HeteroVLMStep:
    """The trainer's step (``__call__(model, micro_batches, num_label_tokens)`` and
    ``eval_loss(model, batch)``) on one rank of the heterogeneous layout; ``bytes_sent``
    counts what this rank put on the bridge."""

    def __init__(self, layout: BridgeLayout, encoder_group, language_group):
        self.layout = layout
        self.rank = dist.get_rank()
        self.is_encoder = self.rank in layout.senders
        self.group = encoder_group if self.is_encoder else language_group
        self.bytes_sent = 0

    def owned(self, model) -> list[torch.nn.Module]:
        names = ENCODER_MODULES if self.is_encoder else LANGUAGE_MODULES
        return [getattr(model, n) for n in names]

    def owned_parameters(self, model) -> list[torch.nn.Parameter]:
        return [p for m in self.owned(model) for p in m.parameters()]

    # ------------------------------------------------------------------ encoder side
    def _serve(self, model, train: bool) -> None:
        """One micro-batch: the images of every lane this rank serves, embeddings out,
        (training) gradients back through projector and ViT."""
        hidden = model.config.hidden_size
        dtype = model.projector.fc2.weight.dtype
        out = []
        for dst, _, _ in self.layout.routes(self.rank):
            grid = recv_2d(dst, torch.int64)
            pixels = recv_2d(dst, torch.float32)
            if grid.shape[0]:
                emb = model.image_embeddings(pixels, grid)
            else:
                emb = torch.zeros(0, hidden, dtype=dtype)
            self.bytes_sent += send_2d(emb, dst)
            out.append((dst, emb))
        if train:
            for dst, emb in out:
                grad = recv_2d(dst, dtype)
                if emb.requires_grad and emb.numel():
                    emb.backward(grad)

    # ------------------------------------------------------------------ language side
    def _lane(self, model, mb: dict, num_label_tokens: int | None) -> torch.Tensor:
        grid = mb.get("image_grid")
        pixels = mb.get("pixel_values")
        if grid is None:
            grid = torch.zeros(0, 2, dtype=torch.int64)
            pixels = torch.zeros(0, model.config.vision_config.patch_dim)
        sources = self.layout.sources(self.rank)
        patch_end = torch.cumsum(grid[:, 0] * grid[:, 1], 0).tolist()
        for src, (a, b) in zip(sources, split_shares(grid.shape[0], len(sources))):
            p0 = patch_end[a - 1] if a else 0
            p1 = patch_end[b - 1] if b else 0
            self.bytes_sent += send_2d(grid[a:b], src)
            self.bytes_sent += send_2d(pixels[p0:p1].float(), src)
        dtype = model.language_model.backbone.embeddings.weight.dtype
        pieces = [recv_2d(src, dtype) for src in sources]
        train = num_label_tokens is not None
        img = torch.cat(pieces).requires_grad_(train)
        h = model.merge_embeddings(mb["input_ids"], img, grid)
        ce = model.language_model(None, position_ids=mb.get("position_ids"),
                                  cu_seqlens=mb.get("cu_seqlens"), labels=mb["labels"],
                                  inputs_embeds=h)
        if train:
            (ce / num_label_tokens).backward()
            grad = img.grad if img.grad is not None else torch.zeros_like(img)
            start = 0
            for src, piece in zip(sources, pieces):
                self.bytes_sent += send_2d(grad[start:start + piece.shape[0]], src)
                start += piece.shape[0]
        return ce.detach().float()

    # ------------------------------------------------------------------ the step
    def __call__(self, model, micro_batches, num_label_tokens: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32)
        for mb in micro_batches:
            if self.is_encoder:
                self._serve(model, train=True)
            else:
                total = total + self._lane(model, mb, num_label_tokens)
        all_reduce_grads(self.owned_parameters(model), self.group)
        return total

    @torch.no_grad()
    def eval_loss(self, model, batch: dict) -> torch.Tensor:
        if self.is_encoder:
            self._serve(model, train=False)
            return torch.zeros((), dtype=torch.float32)
        return self._lane(model, batch, None)

    # ------------------------------------------------------------------ reductions
    def all_reduce_lanes(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the language lanes, result on every rank (encoder ranks hold no
        data stream: their contribution is zero; they learn the global label count this way)."""
        if self.is_encoder:
            t.zero_()
        dist.all_reduce(t)
        return t

    def clip_grad_norm(self, model, max_norm: float | None) -> torch.Tensor:
        """Global gradient norm over both modules (each module's squared norm counted once:
        by the first rank of its set, its gradients being replicated there), clipped."""
        params = [p for p in self.owned_parameters(model) if p.grad is not None]
        leader = self.rank == (self.layout.senders[0] if self.is_encoder else self.layout.receivers[0])
        sq = torch.zeros((), dtype=torch.float64)
        if leader and params:
            sq += sum(p.grad.double().pow(2).sum() for p in params)
        dist.all_reduce(sq)
        norm = sq.sqrt().float()
        if max_norm and params and math.isfinite(float(norm)):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm
