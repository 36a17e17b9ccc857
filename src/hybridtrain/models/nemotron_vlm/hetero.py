"""Heterogeneous layout of the vision-language model: the vision encoder + projector on ranks
``0..E-1`` (data-parallel among themselves), the language model on the others (one lane per
rank), joined by :mod:`hybridtrain.distributed.bridge`.

Each side reads its own data (:func:`data_view`): a language lane reads its samples' text and
image grids (no image decoded), an encoder rank the images of the lanes it serves (its
contiguous share of a lane's images when several encoder ranks serve one lane), micro-batch by
micro-batch in the lanes' order. Per micro-batch an encoder rank sends each lane the projected
embeddings ``[tokens, hidden]`` of its images; the lane receives them (a leaf that requires
grad), scatters them into its placeholders, runs the language model and back-propagates
``loss_sum / global label tokens``, then returns each encoder rank the gradient of its share.
Encoder ranks back-propagate that gradient through projector and ViT. Gradients are then
summed inside each rank set, so both modules hold exactly the one-process gradient of the
per-token mean loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridtrain.distributed.bridge import (
    BridgeLayout,
    all_reduce_grads,
    recv_2d,
    send_2d,
    split_shares,
)

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

    # ------------------------------------------------------------------ encoder side
    def _serve(self, model, mb: dict, train: bool) -> None:
        """One micro-batch (:class:`~hybridtrain.data.vision_sides.ImageSide`'s): the images of
        every lane this rank serves, embeddings out, (training) gradients back through
        projector and ViT."""
        hidden = model.config.hidden_size
        dtype = model.projector.fc2.weight.dtype
        grids = mb["image_grid"].split(mb["lane_images"].tolist())
        pixels_per_lane = mb["pixel_values"].split([int((g[:, 0] * g[:, 1]).sum()) for g in grids])
        out = []
        for (dst, _, _), grid, pixels in zip(self.layout.routes(self.rank), grids,
                                              pixels_per_lane):
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
    def _lane(self, model, mb: dict, num_label_tokens: int | None,
              logits: bool = False) -> torch.Tensor:
        grid = mb.get("image_grid")
        if grid is None:
            grid = torch.zeros(0, 2, dtype=torch.int64)
        sources = self.layout.sources(self.rank)
        dtype = model.language_model.backbone.embeddings.weight.dtype
        pieces = [recv_2d(src, dtype) for src in sources]
        train = num_label_tokens is not None
        img = torch.cat(pieces).requires_grad_(train)
        h = model.merge_embeddings(mb["input_ids"], img, grid)
        ce = model.language_model(None, position_ids=mb.get("position_ids"),
                                  cu_seqlens=mb.get("cu_seqlens"),
                                  labels=None if logits else mb["labels"], inputs_embeds=h)
        if logits:
            return ce
        if train:
            if ce.requires_grad:  # not when nothing upstream of this loss trains (stage 1, no image)
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
                self._serve(model, mb, train=True)
            else:
                total = total + self._lane(model, mb, num_label_tokens)
        all_reduce_grads(model.parameters(), self.group)  # this rank's modules only
        return total

    @torch.no_grad()
    def eval_loss(self, model, batch: dict) -> torch.Tensor:
        if self.is_encoder:
            self._serve(model, batch, train=False)
            return torch.zeros((), dtype=torch.float32)
        return self._lane(model, batch, None)

    @torch.no_grad()
    def eval_logits(self, model, batch: dict) -> torch.Tensor | None:
        """Logits of a validation batch on a language lane (None on encoder ranks)."""
        if self.is_encoder:
            self._serve(model, batch, train=False)
            return None
        return self._lane(model, batch, None, logits=True)


def hetero_plan(model, distributed, world_size: int):
    """The heterogeneous layout of ``distributed.encoder_ranks``: ViT + projector on ranks
    ``0..E-1``, the language model on the rest (one data lane per rank, gradients summed over
    the lanes); each rank keeps only its modules (a side with nothing trainable, e.g. the
    frozen language model of stage 1, gets no optimizer)."""
    from hybridtrain.distributed.hetero import HeteroPlan, LaneDims

    E = distributed.encoder_ranks
    if not 0 < E < world_size:
        raise ValueError(f"distributed.encoder_ranks={E} must leave ranks for the language "
                         f"model: between 1 and {world_size - 1} with {world_size} ranks")
    others = {k: distributed[k] for k in ("dp_replicate", "cp", "tp", "pp", "ep")
              if distributed[k] != 1}
    if others or distributed.dp_shard not in (-1, world_size - E):
        raise ValueError(
            f"distributed.encoder_ranks={E}: the language model's own layout is data-parallel "
            f"lanes only so far; remove {others or {'dp_shard': distributed.dp_shard}}")
    layout = BridgeLayout(range(E), range(E, world_size))
    groups = (dist.new_group(list(layout.senders)), dist.new_group(list(layout.receivers)))
    step = HeteroVLMStep(layout, *groups)
    view = data_view(layout, step.rank)
    if step.is_encoder:
        model.language_model = None
    else:
        model.vision_model = None
        model.projector = None
    return HeteroPlan(model=model, dims=LaneDims(layout, step.rank, world_size), pipeline=step,
                      stages=[model], data_view=view)


def data_view(layout: BridgeLayout, rank: int):
    """What ``rank`` reads of each batch (``HeteroPlan.data_view``): a language lane its own
    samples without pixels, an encoder rank the images (its share of them) of the same
    micro-batches of every lane it serves."""
    from hybridtrain.data.vision_sides import ImageSide, LaneSampler, TextSide

    if rank in layout.receivers:
        return lambda dataset, sampler, collate: (TextSide(dataset), sampler, collate)
    routes = layout.routes(rank)
    lanes = [layout.receivers.index(dst) for dst, _, _ in routes]

    def view(dataset, sampler, collate):
        side = ImageSide(dataset, lambda pos, n: split_shares(n, routes[pos][2])[routes[pos][1]])
        return side, LaneSampler(sampler, lanes), side.collate
    return view
