"""Heterogeneous layout of the vision-language model: the vision encoder + projector on ranks
``0..E-1`` (data-parallel among themselves, FSDP2-sharded over them when ``E > 1``), the
language model on the others with its own ``dp_shard`` / ``dp_replicate`` / ``tp`` / ``pp`` /
``ep``; each side laid out by ``distributed.parallel_plan.parallelize`` over a mesh of its own
ranks only, joined by :mod:`hybridtrain.distributed.bridge` at the first pipeline stage of each
language lane (its first tensor-parallel rank, which passes the embeddings on to the lane's
other tp ranks and returns the gradients).

Each side reads its own data (:func:`data_view`): a language lane reads its samples' text and
image grids (no image decoded), an encoder rank the images of the lanes it serves (its
contiguous share of a lane's images when several encoder ranks serve one lane), micro-batch by
micro-batch in the lanes' order. One step, in two phases on both sides (so that a pipeline
schedule can run all of a lane's micro-batches at once):

1. per micro-batch, an encoder rank sends each lane it serves the projected embeddings
   ``[tokens, hidden]`` of its images and keeps its graph; a lane's first stage receives them,
   lays them out per row (``image_embeds`` [rows, tokens of the row, hidden], a leaf that
   requires grad) and the language model scatters them into the row's placeholders
   (:meth:`NemotronVLMForConditionalGeneration.forward`);
2. the language model runs forward and backward of every micro-batch (its pipeline schedule
   under ``pp``, which splits ``image_embeds`` with the rows) with ``loss_sum / global label
   tokens``; the first stage returns each encoder rank the gradient of its share, and encoder
   ranks back-propagate it through projector and ViT.

FSDP2 reduces each side's gradients over its own ranks (the encoder's after its last
micro-batch's backward). Both modules hold the one-process gradient of the per-token mean loss.
An encoder rank whose share of a micro-batch has no image runs a blank one (and sends none of
it), so all encoder ranks run the same forwards and backwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridtrain.config.sections import config_section
from hybridtrain.data.vision_sides import ImageSide, LaneSampler, TextSide
from hybridtrain.distributed.bridge import (
    BridgeLayout, recv_2d, send_2d, split_shares,
)
from hybridtrain.distributed.hetero import HeteroPlan, LaneDims, receiver_dims
from hybridtrain.distributed.parallel_dims import ParallelDims
from hybridtrain.distributed.parallel_plan import parallelize
from hybridtrain.models.spec import model_spec_for


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
    ``eval_loss(model, batch)``, ``eval_predictions``) on one rank of the heterogeneous layout;
    ``lm_pipeline``: the language model's pipeline step (its plan's, under ``pp``);
    ``bytes_sent`` counts what this rank put on the bridge."""

    def __init__(self, layout: BridgeLayout, dims: ParallelDims, dtype: torch.dtype,
                 lm_pipeline=None):
        self.layout = layout
        self.rank = dist.get_rank()
        self.is_encoder = self.rank in layout.senders
        self.is_receiver = self.rank in layout.receivers  # a lane's first stage, first tp rank
        # on the language side (``dims``: its degrees): a lane's first stage takes the
        # embeddings, its tensor-parallel ranks from the receiver
        self.first_stage = not self.is_encoder and (dims.pp == 1 or dims.local_rank("pp") == 0)
        self.tp_group = dims.group("tp") if dims.tp > 1 and not self.is_encoder else None
        self.tp_source = self.rank - dims.local_rank("tp") if self.tp_group is not None else None
        self.dtype = dtype  # of the embeddings and their gradients on the bridge
        self.lm_pipeline = lm_pipeline
        self.bytes_sent = 0

    # ------------------------------------------------------------------ encoder side
    def _serve(self, model, mb: dict) -> list[tuple[int, torch.Tensor, int]]:
        """One micro-batch (:class:`~hybridtrain.data.vision_sides.ImageSide`'s): the
        embeddings of the images of every lane this rank serves, sent to the lane. A share
        without images runs the encoder on a blank image and sends nothing of it, so that every
        encoder rank runs the same forwards and backwards (FSDP2's collectives)."""
        grids = mb["image_grid"].split(mb["lane_images"].tolist())
        pixels_per_lane = mb["pixel_values"].split([int((g[:, 0] * g[:, 1]).sum()) for g in grids])
        out = []
        for (dst, _, _), grid, pixels in zip(self.layout.routes(self.rank), grids,
                                              pixels_per_lane):
            n = grid.shape[0]
            if not n:
                m = model.config.merge
                grid = torch.tensor([[m, m]])
                pixels = torch.zeros(m * m, model.config.vision_config.patch_dim,
                                     dtype=pixels.dtype)
            emb = model.image_embeddings(pixels, grid)
            self.bytes_sent += send_2d(emb if n else emb[:0], dst)
            out.append((dst, emb, n))
        return out

    def _serve_backward(self, model, served: list[tuple[int, torch.Tensor, int]],
                        last: bool) -> None:
        """The gradients of one micro-batch's embeddings back through projector and ViT
        (FSDP2 reduces the gradients after the ``last`` micro-batch's)."""
        sync = getattr(model, "set_requires_gradient_sync", None)
        for i, (dst, emb, n) in enumerate(served):
            grad = recv_2d(dst, self.dtype)
            if sync is not None:
                sync(last and i == len(served) - 1)
            if emb.requires_grad:
                emb.backward(grad if n else torch.zeros_like(emb))

    # ------------------------------------------------------------------ language side
    def _receive(self, model, mb: dict) -> tuple[torch.Tensor, list[int]]:
        """The embeddings of this lane's micro-batch's images: ([tokens, hidden], the size of
        each encoder rank's share). The lane's other tensor-parallel ranks get them from the
        receiver."""
        grid = mb.get("image_grid")
        has_images = grid is not None and grid.shape[0] > 0
        model._check_counts(mb["input_ids"] == model.config.image_token_id,
                            grid if has_images else None)
        if not self.is_receiver:
            n = int((mb["input_ids"] == model.config.image_token_id).sum())
            img = torch.empty(n, model.config.hidden_size, dtype=self.dtype)
            dist.broadcast(img, self.tp_source, group=self.tp_group)
            return img, []
        pieces = [recv_2d(src, self.dtype) for src in self.layout.sources(self.rank)]
        img = torch.cat(pieces)
        if self.tp_group is not None:
            dist.broadcast(img, self.rank, group=self.tp_group)
        return img, [p.shape[0] for p in pieces]

    def _lane_inputs(self, model, mb: dict, train: bool):
        """(``mb`` with its ``image_embeds`` rows, (rows leaf, valid, share sizes) on a first
        stage, else None). Later pipeline stages get no embeddings (``[rows, 0, hidden]``)."""
        if not self.first_stage:
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
            if r is not None and self.is_receiver:  # tp ranks hold the same gradients
                self._send_grads(r)
        return total

    # ------------------------------------------------------------------ the step
    def __call__(self, model, micro_batches, num_label_tokens: int) -> torch.Tensor:
        if not self.is_encoder:
            return self._lane_step(model, micro_batches, num_label_tokens)
        served = [self._serve(model, mb) for mb in micro_batches]
        for i, s in enumerate(served):
            self._serve_backward(model, s, i == len(served) - 1)
        return torch.zeros((), dtype=torch.float32)

    @torch.no_grad()
    def eval_loss(self, model, batch: dict) -> torch.Tensor:
        if self.is_encoder:
            self._serve(model, batch)
            return torch.zeros((), dtype=torch.float32)
        batch = self._lane_inputs(model, batch, False)[0]
        if self.lm_pipeline is not None:
            return self.lm_pipeline.eval_loss(model, batch)
        return self._forward(model, batch).float()

    @torch.no_grad()
    def eval_predictions(self, model, batch: dict) -> torch.Tensor | None:
        """The predicted tokens ``[rows, L]`` of a validation batch on a language lane (its
        pipeline's under ``pp``), None on encoder ranks."""
        if self.is_encoder:
            self._serve(model, batch)
            return None
        batch = self._lane_inputs(model, batch, False)[0]
        if self.lm_pipeline is not None:
            return self.lm_pipeline.eval_predictions(model, batch)
        return self._forward(model, batch, logits=True).argmax(-1)


def hetero_plan(model, distributed, world_size: int, *, parallelize=None,
                device: torch.device | str = "cpu", autocast_dtype: torch.dtype | None = None):
    """The heterogeneous layout of ``distributed.encoder_ranks``: ViT + projector on ranks
    ``0..E-1`` (FSDP2 over them), the language model on the rest, each side laid out by
    ``parallelize(model, dims) -> ParallelPlan`` (default: ``distributed.parallel_plan.parallelize``
    with the default training section) over its own ``ParallelDims``; each rank keeps only
    its modules (a side with nothing trainable, e.g. the frozen language model of stage 1,
    gets no optimizer)."""
    E = distributed.encoder_ranks
    if not 0 < E < world_size:
        raise ValueError(f"distributed.encoder_ranks={E} must leave ranks for the language "
                         f"model: between 1 and {world_size - 1} with {world_size} ranks")
    dtype = model.projector.fc2.weight.dtype
    device = torch.device(device)
    senders, dims, layout = receiver_dims(distributed, E, world_size, device.type)
    rank = dist.get_rank()
    if parallelize is None:
        parallelize = _default_parallelize(distributed, device, autocast_dtype)
    if rank in layout.senders:  # data-parallel encoder: FSDP2 over the encoder's ranks
        model.language_model = None
        inner = parallelize(model, senders)
        lm_pipeline = None
    else:
        model.vision_model = None
        model.projector = None
        inner = parallelize(model, dims)
        lm_pipeline = inner.pipeline
    step = HeteroVLMStep(layout, dims, dtype, lm_pipeline)
    return HeteroPlan(model=inner.model, dims=LaneDims(layout, dims, rank, world_size),
                      pipeline=step, stages=inner.stages, inner=inner,
                      data_view=data_view(layout, rank), device=device,
                      autocast_dtype=autocast_dtype)


def hetero_sides(model) -> tuple:
    """(encoder: ViT + projector, rest: the language model) of a meta-device ``model``, each a
    model of its own holding the other side as None (as :func:`hetero_plan` leaves each rank's),
    sharing ``model``'s modules (``HeteroSupport.sides``)."""
    with torch.device("meta"):
        encoder = type(model)(model.config, language_model=model.language_model)
        rest = type(model)(model.config, language_model=model.language_model)
    encoder.vision_model, encoder.projector, encoder.language_model = \
        model.vision_model, model.projector, None
    rest.vision_model = rest.projector = None
    return encoder, rest


def data_view(layout: BridgeLayout, rank: int):
    """What ``rank`` reads of each batch (``HeteroPlan.data_view``): a language rank its lane's
    samples without pixels, an encoder rank the images (its share of them) of the same
    micro-batches of every lane it serves."""
    if rank not in layout.senders:
        return lambda dataset, sampler, collate: (TextSide(dataset), sampler, collate)
    routes = layout.routes(rank)
    lanes = [layout.receivers.index(dst) for dst, _, _ in routes]

    def view(dataset, sampler, collate):
        side = ImageSide(dataset, lambda pos, n: split_shares(n, routes[pos][2])[routes[pos][1]])
        return side, LaneSampler(sampler, lanes), side.collate
    return view


def _default_parallelize(distributed, device: torch.device, autocast_dtype: torch.dtype | None):
    def run(model, dims):
        return parallelize(model_spec_for(model), model, dims,
                           config_section("distributed", distributed), config_section("training"),
                           device=device, autocast_dtype=autocast_dtype)
    return run
