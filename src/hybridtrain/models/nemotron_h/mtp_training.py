"""Training Nemotron-H's multi-token prediction layers (the spec's ``AuxiliaryLosses`` part) and
watching and balancing its routers (``ExpertRouting``).

``training.mtp``: ``train`` (one loss term per depth, each weighted ``training.mtp_loss_scale /
depths`` and normalised by the global count of positions with a target at that depth, see
:mod:`hybridtrain.ops.aux_loss`), ``freeze`` (kept and exported unchanged) or ``drop`` (left
out of the model, its training and its export: the exported config.json has no MTP layers).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hybridtrain.ops.aux_loss import AuxiliaryLoss
from hybridtrain.ops.expert_load import ExpertLoad
from hybridtrain.ops.labels import IGNORE_INDEX

from .model import seq_idx_from_cu_seqlens, seq_idx_from_position_ids
from .mtp import depth_labels

logger = logging.getLogger(__name__)


def batch_seq_idx(batch: dict) -> torch.Tensor | None:
    """The batch's document id per token (None: one document per row), as the model derives it."""
    B, L = batch["labels"].shape
    if batch.get("cu_seqlens") is not None:
        return seq_idx_from_cu_seqlens(torch.as_tensor(batch["cu_seqlens"]), B, L)
    if batch.get("position_ids") is not None:
        return seq_idx_from_position_ids(batch["position_ids"], B, L)
    return None


def depth_counts(batch: dict, depths: int) -> torch.Tensor:
    """Positions with a target at each MTP depth 1..``depths`` in ``batch`` (float64 [depths])."""
    labels, seq_idx = batch["labels"], batch_seq_idx(batch)
    return torch.stack([(depth_labels(labels, k, seq_idx) != IGNORE_INDEX).sum()
                        for k in range(1, depths + 1)]).to(torch.float64)


def apply_mtp_choice(model: nn.Module, training) -> int:
    """Applies ``training.mtp`` to ``model`` (see the module docstring); the depths to train."""
    if model.mtp is None:
        return 0
    config, choice = model.config, training.mtp
    depths = config.num_nextn_predict_layers
    what = f"{depths} multi-token prediction depth(s) of pattern {config.mtp_hybrid_override_pattern!r}"
    if choice == "drop":
        model.mtp = None
        model.config = config.replace(num_nextn_predict_layers=0, mtp_layers_block_type=None)
        logger.warning("training.mtp=drop: the model's %s are left out of training and of the "
                       "export (its config.json will have none)", what)
        return 0
    if choice == "freeze":
        model.mtp.requires_grad_(False)
        logger.info("training.mtp=freeze: the model's %s are kept and exported unchanged", what)
        return 0
    logger.info("training.mtp=train: %s trained, loss weight %g averaged over depths (mtp_loss "
                "in the step records)", what, float(training.mtp_loss_scale))
    return depths


def batch_rows(batch: dict) -> torch.Tensor:
    """The rows of a micro-batch (the sequence-level balance loss's normaliser), float64 [1]."""
    return torch.tensor([float(batch["labels"].shape[0])], dtype=torch.float64)


def setup_aux_losses(model: nn.Module, training) -> AuxiliaryLoss | None:
    """The spec's ``AuxiliaryLosses.setup``: ``training.mtp`` applied, then the objective of the
    MTP depths trained (``mtp_loss_k``, averaged as ``mtp_loss``) and, with
    ``training.moe_aux_loss_coeff``, of the routers' sequence-level balance loss
    (``moe_aux_loss``: per row, summed over the MoE layers; normalised by the global row count)."""
    depths = apply_mtp_choice(model, training)
    coeff = float(training.moe_aux_loss_coeff)
    # the routers that run in a training forward (the MTP layers' only when they train)
    routers = {n: r for n, r in model.moe_routers().items()
               if coeff and (depths or not n.startswith("mtp."))}
    names = [f"mtp_loss_{k}" for k in range(1, depths + 1)]
    weights = [float(training.mtp_loss_scale) / depths] * depths if depths else []
    counters = [lambda batch: depth_counts(batch, depths)] if depths else []
    if routers:
        logger.info("training.moe_aux_loss_coeff=%g: the sequence-level balance loss of %d MoE "
                    "layers joins the objective (moe_aux_loss in the step records)", coeff, len(routers))
        for r in routers.values():
            r.seq_aux_loss = True
        names.append("moe_aux_loss")
        weights.append(coeff)
        counters.append(batch_rows)
    if not names:
        return None
    loss = AuxiliaryLoss(names, weights, lambda batch: torch.cat([c(batch) for c in counters]),
                         averages={"mtp_loss": range(depths)} if depths else None)
    model.aux_loss, model.aux_terms = loss, ("mtp",) * bool(depths) + ("moe_aux",) * bool(routers)
    return loss


def moe_layer_names(config) -> list[str]:
    """Every MoE layer of a model of ``config``: the main stack's, then the MTP layers'."""
    names = [f"backbone.layers.{i}" for i, t in enumerate(config.layers_block_type) if t == "moe"]
    mtp = (config.mtp_layers_block_type or []) * config.num_nextn_predict_layers
    return names + [f"mtp.layers.{i}" for i, t in enumerate(mtp) if t == "moe"]


def setup_expert_load(model: nn.Module, training) -> ExpertLoad | None:
    """The step's expert load of ``model``'s MoE layers (metrics always; the correction-bias
    update at ``training.moe_bias_update_rate``, logged when on)."""
    # the MTP layers' routers run in a training forward only when those layers train
    names = [n for n in moe_layer_names(model.config) if "mtp" in model.aux_terms or not n.startswith("mtp.")]
    if not names:
        return None
    rate = float(training.moe_bias_update_rate)
    if rate:
        logger.info("training.moe_bias_update_rate=%g: after each optimizer step every router's "
                    "e_score_correction_bias moves toward its under-loaded experts", rate)
    for name, router in model.moe_routers().items():
        router.count_tokens = name in names
    load = ExpertLoad(names, model.config.n_routed_experts,
                      lambda: {n: r.e_score_correction_bias for n, r in model.moe_routers().items()
                               if r.count_tokens}, rate)
    model.expert_load = load
    return load
