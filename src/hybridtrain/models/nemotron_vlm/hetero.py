"""Heterogeneous layout of the vision-language model: the vision encoder + projector on ranks
``0..E-1`` (data-parallel among themselves), the language model on the others with its own
``dp_shard`` / ``dp_replicate`` / ``pp`` / ``ep`` (laid out by ``distributed.plan.parallelize``
over a mesh of those ranks only), joined by :mod:`hybridtrain.distributed.bridge` at the first
pipeline stage of each language lane.

One step, in two phases on both sides (so that a pipeline schedule can run all of a lane's
micro-batches at once):

1. per micro-batch, a lane's first stage sends its images (``image_grid`` + ``pixel_values``,
   split in contiguous shares when several encoder ranks serve it) and receives the projected
   embeddings ``[tokens, hidden]``; it lays them out per row (``image_embeds`` [rows, tokens of
   the row, hidden], a leaf that requires grad) and the language model scatters them into the
   row's placeholders (:meth:`NemotronVLMForConditionalGeneration.forward`); encoder ranks keep
   their graphs;
2. the language model runs forward and backward of every micro-batch (its pipeline schedule
   under ``pp``, which splits ``image_embeds`` with the rows) with ``loss_sum / global label
   tokens``; the first stage returns each encoder rank the gradient of its share, and encoder
   ranks back-propagate it through projector and ViT.

The encoder ranks then sum their gradients (replicated); the language model's plan reduces its
own (FSDP). Both modules hold exactly the one-process gradient of the per-token mean loss.
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


def rows_of_embeddings(input_ids: torch.Tensor, image_embeds: torch.Tensor, image_token_id: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[rows, T, hidden]``: row ``b``'s image embeddings in placeholder order, zero-padded
    to the longest row; ``valid`` [rows, T]: the filled entries) of a micro-batch's embeddings
    ``[tokens, hidden]`` (the images of all rows, in order; counts already checked)."""
    n = (input_ids == image_token_id).sum(1)
    T = int(n.max()) if n.numel() else 0
    valid = torch.arange(T, device=n.device)[None] < n[:, None]
    rows = image_embeds.new_zeros(input_ids.shape[0], T, image_embeds.shape[-1])
    rows[valid] = image_embeds.detach()
    return rows, valid


class HeteroVLMStep:
    """The trainer's step (``__call__(model, micro_batches, num_label_tokens)``,
    ``eval_loss(model, batch)``, ``eval_logits``) on one rank of the heterogeneous layout;
    ``lm_pipeline``: the language model's pipeline step (its plan's, under ``pp``);
    ``bytes_sent`` counts what this rank put on the bridge."""

    def __init__(self, layout: BridgeLayout, encoder_group, dtype: torch.dtype,
                 lm_pipeline=None):
        self.layout = layout
        self.rank = dist.get_rank()
        self.is_encoder = self.rank in layout.senders
        self.is_receiver = self.rank in layout.receivers  # a language lane's first stage
        self.encoder_group = encoder_group
        self.dtype = dtype  # of the embeddings and their gradients on the bridge
        self.lm_pipeline = lm_pipeline
        self.bytes_sent = 0

    # ------------------------------------------------------------------ encoder side
    def _serve(self, model) -> list[tuple[int, torch.Tensor]]:
        """One micro-batch: the images of every lane this rank serves in, embeddings out."""
        out = []
        for dst, _, _ in self.layout.routes(self.rank):
            grid = recv_2d(dst, torch.int64)
            pixels = recv_2d(dst, torch.float32)
            if grid.shape[0]:
                emb = model.image_embeddings(pixels, grid)
            else:
                emb = torch.zeros(0, model.config.hidden_size, dtype=self.dtype)
            self.bytes_sent += send_2d(emb, dst)
            out.append((dst, emb))
        return out

    def _serve_backward(self, served: list[tuple[int, torch.Tensor]]) -> None:
        for dst, emb in served:
            grad = recv_2d(dst, self.dtype)
            if emb.requires_grad and emb.numel():
                emb.backward(grad)

    # ------------------------------------------------------------------ language side
    def _receive(self, model, mb: dict) -> tuple[torch.Tensor, list[int]]:
        """This lane's micro-batch's images out, their embeddings in: ([tokens, hidden], the
        size of each encoder rank's share)."""
        grid = mb.get("image_grid")
        pixels = mb.get("pixel_values")
        if grid is None:
            grid = torch.zeros(0, 2, dtype=torch.int64)
            pixels = torch.zeros(0, model.config.vision_config.patch_dim)
        has_images = grid.shape[0] > 0
        model._check_counts(mb["input_ids"] == model.config.image_token_id,
                            grid if has_images else None)
        sources = self.layout.sources(self.rank)
        patch_end = torch.cumsum(grid[:, 0] * grid[:, 1], 0).tolist()
        for src, (a, b) in zip(sources, split_shares(grid.shape[0], len(sources))):
            p0 = patch_end[a - 1] if a else 0
            p1 = patch_end[b - 1] if b else 0
            self.bytes_sent += send_2d(grid[a:b], src)
            self.bytes_sent += send_2d(pixels[p0:p1].float(), src)
        pieces = [recv_2d(src, self.dtype) for src in sources]
        return torch.cat(pieces), [p.shape[0] for p in pieces]

    def _lane_inputs(self, model, mb: dict, train: bool):
        """(``mb`` with its ``image_embeds`` rows, (rows leaf, valid, share sizes) on a first
        stage, else None). Later pipeline stages get no embeddings (``[rows, 0, hidden]``)."""
        if not self.is_receiver:
            rows = torch.zeros(mb["input_ids"].shape[0], 0, model.config.hidden_size,
                               dtype=self.dtype)
            return {**mb, "image_embeds": rows}, None
        img, shares = self._receive(model, mb)
        rows, valid = rows_of_embeddings(mb["input_ids"], img, model.config.image_token_id)
        rows.requires_grad_(train)
        return {**mb, "image_embeds": rows}, (rows, valid, shares)

    def _send_grads(self, received) -> None:
        rows, valid, shares = received
        grad = rows.grad[valid] if rows.grad is not None else \
            rows.new_zeros(int(valid.sum()), rows.shape[-1])
        start = 0
        for src, n in zip(self.layout.sources(self.rank), shares):
            self.bytes_sent += send_2d(grad[start:start + n], src)
            start += n

    @staticmethod
    def _forward(model, mb: dict, logits: bool = False) -> torch.Tensor:
        return model(mb["input_ids"], position_ids=mb.get("position_ids"),
                     cu_seqlens=mb.get("cu_seqlens"), labels=None if logits else mb["labels"],
                     image_embeds=mb["image_embeds"])

    def _lane_step(self, model, micro_batches, num_label_tokens: int) -> torch.Tensor:
        ins, received = zip(*[self._lane_inputs(model, mb, True) for mb in micro_batches])
        if self.lm_pipeline is not None:
            total = self.lm_pipeline(model, list(ins), num_label_tokens)
        else:
            total = torch.zeros((), dtype=torch.float32)
            sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2: once per step
            for i, mb in enumerate(ins):
                if sync is not None:
                    sync(i == len(ins) - 1)
                ce = self._forward(model, mb)
                if ce.requires_grad:  # not when nothing upstream of this loss trains
                    (ce / num_label_tokens).backward()
                total = total + ce.detach().float()
        for r in received:
            if r is not None:
                self._send_grads(r)
        return total

    # ------------------------------------------------------------------ the step
    def __call__(self, model, micro_batches, num_label_tokens: int) -> torch.Tensor:
        if not self.is_encoder:
            return self._lane_step(model, micro_batches, num_label_tokens)
        served = [self._serve(model) for _ in micro_batches]
        for s in served:
            self._serve_backward(s)
        all_reduce_grads(model.parameters(), self.encoder_group)  # replicated encoder
        return torch.zeros((), dtype=torch.float32)

    @torch.no_grad()
    def eval_loss(self, model, batch: dict) -> torch.Tensor:
        if self.is_encoder:
            self._serve(model)
            return torch.zeros((), dtype=torch.float32)
        batch = self._lane_inputs(model, batch, False)[0]
        if self.lm_pipeline is not None:
            return self.lm_pipeline.eval_loss(model, batch)
        return self._forward(model, batch).float()

    @torch.no_grad()
    def eval_logits(self, model, batch: dict) -> torch.Tensor | None:
        """Logits of a validation batch on a language lane (None on encoder ranks)."""
        if self.is_encoder:
            self._serve(model)
            return None
        if self.lm_pipeline is not None:
            raise ValueError("training.val_accuracy is not available under pipeline "
                             "parallelism (distributed.pp > 1); set it to false")
        return self._forward(model, self._lane_inputs(model, batch, False)[0], logits=True)


def hetero_plan(model, distributed, world_size: int, require_trainable: bool = True, *,
                parallelize=None, device: torch.device | str = "cpu"):
    """The heterogeneous layout of ``distributed.encoder_ranks``: ViT + projector on ranks
    ``0..E-1`` (replicated), the language model on the rest laid out by
    ``parallelize(model, dims) -> ParallelPlan`` (default: ``distributed.plan.parallelize``
    with the schema's training section) over their own ``ParallelDims``; each rank keeps only
    its modules. ``require_trainable``: refuse a side with nothing to train (the recipe's
    trainer needs an optimizer on every rank; a loop that gives such ranks no optimizer
    passes False)."""
    from hybridtrain.distributed.hetero import HeteroPlan, LaneDims, receiver_dims

    E = distributed.encoder_ranks
    if not 0 < E < world_size:
        raise ValueError(f"distributed.encoder_ranks={E} must leave ranks for the language "
                         f"model: between 1 and {world_size - 1} with {world_size} ranks")
    for what, modules in (("vision encoder and projector", (model.vision_model, model.projector)),
                          ("language model", (model.language_model,))):
        if require_trainable and not any(p.requires_grad for m in modules for p in m.parameters()):
            raise ValueError(
                f"distributed.encoder_ranks={E}: the {what} is frozen (model.freeze), so its "
                "ranks would have nothing to train (no optimizer there is not supported by the "
                "recipe's trainer yet); train this stage with encoder_ranks: 0 (colocated)")
    dtype = model.projector.fc2.weight.dtype
    device = torch.device(device)
    dims, layout = receiver_dims(distributed, E, world_size, device.type)
    encoder_group = dist.new_group(list(layout.senders))
    rank = dist.get_rank()
    inner = None
    if rank in layout.senders:
        model.language_model = None
        lm_pipeline, stages = None, [model]
    else:
        model.vision_model = None
        model.projector = None
        if parallelize is None:
            parallelize = _default_parallelize(distributed, device)
        inner = parallelize(model, dims)
        model, lm_pipeline, stages = inner.model, inner.pipeline, inner.stages
    step = HeteroVLMStep(layout, encoder_group, dtype, lm_pipeline)
    return HeteroPlan(model=model, dims=LaneDims(layout, dims, rank, world_size), pipeline=step,
                      stages=stages, inner=inner)


def _default_parallelize(distributed, device: torch.device):
    from hybridtrain.distributed.layout import config_section
    from hybridtrain.distributed.plan import parallelize
    from hybridtrain.models.spec import model_spec_for

    def run(model, dims):
        return parallelize(model_spec_for(model), model, dims, distributed,
                           config_section("training"), device=device, autocast_dtype=None)
    return run
