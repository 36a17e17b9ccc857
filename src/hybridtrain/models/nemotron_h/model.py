"""Nemotron-H causal LM: embeddings -> pre-norm residual blocks (Mamba2 / attention / MLP / MoE)
-> norm_f -> untied lm_head. Module names equal the Hub's parameter names
(``backbone.embeddings``, ``backbone.layers.{i}.norm``, ``backbone.layers.{i}.mixer.*``,
``backbone.norm_f``, ``lm_head``); only the MoE experts are stacked here (see ``hf_io``).

Packed sequences: pass ``cu_seqlens`` (cumulative document lengths over the flattened
``B * L`` tokens, as flash-attn's varlen API; a row boundary always ends a document) or
``position_ids`` that restart at each document. The model derives one ``seq_idx`` [B, L]
(document id of every token) from them; Mamba2 restarts its conv and SSM state at every
document, attention never crosses one (and costs the sum of the documents' causal squares).

Context parallelism: once ``parallelize`` has set ``context_parallel``, forward takes this rank's
contiguous slice of every row with its ``position_ids``
(``hybridtrain.distributed.context_parallel.shard_batch``) and returns the slice's outputs (or
its loss); see :mod:`.context_parallel`.

Sequence parallelism (with tensor parallelism): once ``parallelize`` has set
``sequence_parallel``, the residual stream and the norms hold each tp rank's part of the rows;
every block gathers the whole rows for its mixer and keeps its part of the mixer's output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
from torch import nn

from hybridtrain.distributed.context_parallel import gather_sequence
from hybridtrain.ops.loss import LinearCrossEntropy
from hybridtrain.ops.sampling import GenerationConfig
from .blocks import MIXERS, Block, SequenceInfo  # noqa: F401 (MIXERS, Block: this module's API)
from .cache import cache_bytes
from .config import NemotronHConfig
from .context_parallel import CPSlice
from .generation import generate
from .hf_io import load_pretrained, save_pretrained
from .mtp import MTPLayer, MultiTokenPredictor, depth_labels, shift_left
from .norms import RMSNorm


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Document id per token, [batch, length] int32, from cumulative lengths over the flattened
    ``batch * length`` tokens. Every row start also starts a document."""
    if not torch.is_tensor(cu_seqlens):
        cu_seqlens = torch.tensor(cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [num_docs + 1], got shape {tuple(cu_seqlens.shape)} "
            f"dtype {cu_seqlens.dtype}"
        )
    n = batch * length
    cu = cu_seqlens.long()
    if int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at batch*seq_len = {n}; got "
            f"{cu.tolist() if cu.numel() <= 16 else str(cu[:8].tolist()) + '...'}"
        )
    starts = torch.zeros(n + 1, dtype=torch.int32, device=cu.device)
    starts[cu[:-1]] = 1
    starts = starts[:n].view(batch, length)
    starts[:, 0] = 1
    return (torch.cumsum(starts.view(-1), 0, dtype=torch.int32) - 1).view(batch, length)


def seq_idx_from_position_ids(position_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Document id per token: a new document starts wherever the position does not continue
    (``pos[t] != pos[t-1] + 1``), and at every row start."""
    pos = position_ids
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() != 2 or pos.shape[-1] != length or pos.shape[0] not in (1, batch):
        raise ValueError(
            f"position_ids must have shape [batch, seq_len] = [{batch}, {length}] (or [seq_len]); "
            f"got {tuple(position_ids.shape)}"
        )
    pos = pos.expand(batch, length)
    starts = torch.ones(batch, length, dtype=torch.int32, device=pos.device)
    starts[:, 1:] = (pos[:, 1:] != pos[:, :-1] + 1).to(torch.int32)
    return (torch.cumsum(starts.view(-1), 0, dtype=torch.int32) - 1).view(batch, length)


class NemotronHModel(nn.Module):
    """``layer_ids``: the blocks to build (default all; a pipeline stage's shell builds none)."""

    def __init__(self, config: NemotronHConfig, layer_ids: Iterable[int] | None = None):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        # a dict keyed "0".."N-1": same parameter names as a list, and pipeline stages can drop
        # layers without renaming the others
        ids = range(config.num_hidden_layers) if layer_ids is None else layer_ids
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in ids})
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class NemotronHForCausalLM(nn.Module):
    """The model. ``forward(input_ids, position_ids=None, cu_seqlens=None, labels=None,
    inputs_embeds=None)`` (``inputs_embeds`` [B, L, H] replaces the embedded ``input_ids``) returns
    fp32 logits [B, L, V], or with ``labels`` (aligned with the inputs, i.e. already shifted;
    -100 = no loss) the loss of ``self.loss`` (the chunked linear cross-entropy: the mean over
    label tokens by default; training installs a summing one). ``hidden_states(...)`` returns the
    final normed hidden states [B, L, H] without the head.

    A pipeline stage is this model with the parts it does not own set to ``None`` (see
    :meth:`pipeline_stage`): without embeddings it takes hidden states as ``input_ids``, without
    the head it returns its hidden states."""

    name_or_path: str | None = None  # the folder from_pretrained read
    checkpoint_dtype: torch.dtype | None = None  # the dtype it stored

    def __init__(self, config: NemotronHConfig, layer_ids: Iterable[int] | None = None):
        super().__init__()
        if not isinstance(config, NemotronHConfig):
            raise ValueError(f"expected a NemotronHConfig, got {type(config).__name__}")
        self.config = config
        self.backbone = NemotronHModel(config, layer_ids)
        # multi-token prediction layers (`mtp.layers.*`, see mtp.py)
        self.mtp = MultiTokenPredictor(config) if config.num_nextn_predict_layers else None
        # training's extra objectives (a hybridtrain.ops.aux_loss.AuxiliaryLoss, set by
        # mtp_training): `aux_terms` names them in order, "mtp" (one term per depth) and
        # "moe_aux" (the routers' sequence-level balance loss)
        self.aux_loss = None
        self.aux_terms: tuple[str, ...] = ()
        # a pipeline stage of a model whose MTP layers train: the stages hand on the MTP
        # depths' input embeddings beside the hidden states (see `pipeline_stage`)
        self.carries_mtp_inputs = False
        # the step's expert load (hybridtrain.ops.expert_load.ExpertLoad), set by training
        self.expert_load = None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # (registered last)
        self.loss = LinearCrossEntropy(reduction="mean")
        # set by parallelize under context parallelism: forward then takes this rank's slice
        # of every row (hybridtrain.distributed.context_parallel.shard_batch)
        self.context_parallel = None
        # set by parallelize under sequence parallelism (distributed.tensor_parallel)
        self.sequence_parallel = None
        if not self.lm_head.weight.is_meta:
            self.init_weights()

    def pipeline_stage(self, layer_ids: Iterable[int], is_first: bool, is_last: bool
                       ) -> "NemotronHForCausalLM":
        """A model holding this one's layers ``layer_ids`` (the same module objects, so the same
        parameters and names), its embeddings when ``is_first``, ``norm_f`` + head + loss when
        ``is_last``, and nothing else.

        When the MTP layers train, the stages' activations carry their depths' input embeddings
        (the embedded tokens ahead, [B, L, depths * H]) after the hidden states: the first stage
        computes them (it holds the embeddings), the ones between hand them on, the last stage
        (with the MTP layers) reads them; their gradient flows back through the pipeline to the
        embeddings, so no stage holds a second copy of that weight."""
        with torch.device("meta"):
            stage = type(self)(self.config, layer_ids=())
        bb = self.backbone
        stage.backbone.layers = nn.ModuleDict({str(i): bb.layers[str(i)] for i in layer_ids})
        stage.backbone.embeddings = bb.embeddings if is_first else None
        stage.backbone.norm_f = bb.norm_f if is_last else None
        stage.lm_head = self.lm_head if is_last else None
        stage.mtp = self.mtp if is_last else None
        stage.aux_loss, stage.aux_terms = self.aux_loss, self.aux_terms
        stage.carries_mtp_inputs = "mtp" in self.aux_terms and not (is_first and is_last)
        stage.expert_load = self.expert_load
        stage.loss = self.loss
        stage.context_parallel = self.context_parallel
        stage.sequence_parallel = self.sequence_parallel
        return stage

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self) -> None:
        """Reference initialisation (transformers' ``_init_weights`` for Nemotron-H): normal(0,
        initializer_range) for linear / conv / embedding / expert / router weights, zero biases,
        norms at one, Mamba ``A_log = log(1..H)``, ``D = 1``, ``dt_bias = softplus^-1(dt)`` with
        dt log-uniform in [time_step_min, time_step_max] floored at time_step_floor, and Mamba
        ``out_proj`` scaled by 1/sqrt(num_layers) when ``rescale_prenorm_residual``."""
        for name, init in self.init_units():
            init(self.get_submodule(name))

    def init_units(self) -> list[tuple[str, Callable[[nn.Module], None]]]:
        """The initialisation in independent parts, in order: (submodule name, function that
        initialises that submodule in place). :meth:`init_weights` runs them on one RNG stream;
        a model built on the meta device runs each on its own seeded stream
        (``hybridtrain.distributed.materialize``)."""
        std = self.config.initializer_range

        def normal(m: nn.Module) -> None:
            nn.init.normal_(m.weight, mean=0.0, std=std)

        bb = self.backbone
        units = [("backbone.embeddings", normal)] if bb.embeddings is not None else []
        units += [(f"backbone.layers.{k}", Block.reset_parameters) for k in bb.layers]
        if bb.norm_f is not None:
            units.append(("backbone.norm_f", RMSNorm.reset_parameters))
        if self.lm_head is not None:
            units.append(("lm_head", normal))
        if self.mtp is not None:
            units += [(f"mtp.layers.{k}", MTPLayer.reset_parameters) for k in self.mtp.layers]
        return units

    # ------------------------------------------------------------------ forward
    def sequence_info(
        self,
        batch: int,
        length: int,
        device: torch.device,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> SequenceInfo:
        """Derive ``seq_idx`` once per forward (under context parallelism, of the whole rows:
        the ranks' position ids are gathered)."""
        cp = self.context_parallel
        if cp is not None and cp.size > 1:
            return self._cp_sequence_info(cp, batch, length, device, position_ids, cu_seqlens)
        if cu_seqlens is not None:
            seq_idx = seq_idx_from_cu_seqlens(torch.as_tensor(cu_seqlens, device=device), batch, length)
        elif position_ids is not None:
            seq_idx = seq_idx_from_position_ids(position_ids.to(device), batch, length)
        else:
            return SequenceInfo()
        # one document per row: the plain (faster) causal paths are exact
        if int(seq_idx[:, -1].sub(seq_idx[:, 0]).max()) == 0:
            return SequenceInfo()
        return SequenceInfo(seq_idx=seq_idx)

    def _cp_sequence_info(self, cp, batch, length, device, position_ids, cu_seqlens) -> SequenceInfo:
        if cu_seqlens is not None:
            raise ValueError(
                "context parallelism: forward takes this rank's slice of the rows with their "
                "position_ids; cu_seqlens (over whole rows) cannot be sliced -- pass the batch "
                "through hybridtrain.distributed.context_parallel.shard_batch")
        if position_ids is None:
            seq_idx = None
        else:
            pos = position_ids.to(device).expand(batch, length).contiguous()
            full = gather_sequence(pos, 1, cp)  # [B, L * cp]
            seq_idx = seq_idx_from_position_ids(full, batch, full.shape[1])
            if int(seq_idx[:, -1].sub(seq_idx[:, 0]).max()) == 0:
                seq_idx = None
        part = CPSlice(cp, cp.rank * length, seq_idx)
        return SequenceInfo(seq_idx=part.local_seq_idx(length), cp=part)

    def hidden_states(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, L, H] (after ``norm_f``), without the lm_head."""
        return self._hidden_states(input_ids, position_ids, cu_seqlens, inputs_embeds)[0]

    def _hidden_states(self, input_ids, position_ids, cu_seqlens, inputs_embeds
                       ) -> tuple[torch.Tensor, SequenceInfo, list[torch.Tensor] | None]:
        """(hidden states, the forward's SequenceInfo, the MTP depths' input embeddings a
        pipeline stage carries: see :meth:`pipeline_stage`; else None)."""
        bb = self.backbone
        carried = None
        if inputs_embeds is not None:
            h = inputs_embeds
        elif bb.embeddings is not None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            h = bb.embeddings(input_ids)
        else:  # a pipeline stage without the embeddings receives hidden states
            h = input_ids
            if self.carries_mtp_inputs:
                h, *carried = h.split(self.config.hidden_size, dim=-1)
        B, L = h.shape[:2]
        info = self.sequence_info(B, L, h.device, position_ids=position_ids, cu_seqlens=cu_seqlens)
        if self.carries_mtp_inputs and carried is None:  # the first stage
            carried = self.mtp_embeddings(input_ids, info)
        sp = info.sp = self.sequence_parallel
        if sp is not None:  # blocks in and out: this rank's part of the rows
            info.length = L
            h = sp.shard(h)
        for block in bb.layers.values():
            h = block(h, info)
        if bb.norm_f is not None:
            h = bb.norm_f(h, sp)
        return (h if sp is None else sp.gather(h, L)), info, carried

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h, info, carried = self._hidden_states(input_ids, position_ids, cu_seqlens, inputs_embeds)
        aux = self.aux_loss if self.aux_loss is not None and self.aux_loss.active else None
        if self.lm_head is None:  # a pipeline stage before the last
            self._count_expert_load()
            out = h if carried is None else torch.cat([h, *(e.to(h.dtype) for e in carried)], dim=-1)
            balance = self._balance_terms() if aux is not None else []
            # this stage's part of the balance loss rides on its output's backward
            return aux.attach(out, balance, at=[aux.num_terms - 1]) if balance else out
        if labels is None:
            return self.lm_head(h).float()
        loss = self.loss(h, self.lm_head, labels)
        if aux is not None:
            terms = self.mtp_losses(h, input_ids, labels, info, carried) if "mtp" in self.aux_terms else []
            n_mtp = len(terms)
            terms += self._balance_terms()  # (read after the MTP layers ran)
            loss = aux.attach(loss, terms, at=list(range(n_mtp)) + [aux.num_terms - 1] * (len(terms) - n_mtp))
        self._count_expert_load()
        return loss

    def _balance_terms(self) -> list[torch.Tensor]:
        """[the sequence-level balance loss of this (stage) model's routers, summed over its
        layers], or [] where the objective has none or no router of this model ran it."""
        if "moe_aux" not in self.aux_terms:
            return []
        losses = [r.last_seq_aux for r in self.moe_routers().values() if r.seq_aux_loss]
        return [sum(losses)] if losses else []

    def moe_routers(self) -> dict[str, nn.Module]:
        """The routers of the MoE layers this (stage) model holds, by layer name
        (``backbone.layers.{i}``, ``mtp.layers.{i}``)."""
        stacks = [("backbone.layers", self.backbone.layers)]
        if self.mtp is not None:
            stacks.append(("mtp.layers", self.mtp.layers))
        return {f"{prefix}.{k}": block.mixer.gate for prefix, stack in stacks
                for k, block in stack.items() if block.block_type == "moe"}

    def _count_expert_load(self) -> None:
        if self.expert_load is not None and self.expert_load.active:
            self.expert_load.add({n: r.tokens_per_expert for n, r in self.moe_routers().items()
                                  if r.count_tokens})

    def mtp_losses(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                   info: SequenceInfo, embeds: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Each MTP depth's loss (``self.loss``: a sum in training) over a batch whose main
        hidden states are ``hidden``: depth k's targets are :func:`.mtp.depth_labels`.
        ``embeds``: the depths' input embeddings (a pipeline's last stage receives them; None:
        :meth:`mtp_embeddings` of ``input_ids``)."""
        assert self.mtp is not None, "MTP training needs the MTP layers on this model (stage)"
        if embeds is None:
            embeds = self.mtp_embeddings(input_ids, info)
        labels, seq_idx, cut = _whole_rows(labels, info)
        outs = self.mtp.hidden_states(hidden, embeds, info)
        return [self._ce_sum(h, depth_labels(labels, k + 1, seq_idx)[:, cut]) for k, h in enumerate(outs)]

    def _ce_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The cross-entropy sum of ``labels`` through the head and ``self.loss``, also where
        that loss gives per-token log-probs (an RL policy's head: 0 where a label is ignored)."""
        out = self.loss(hidden, self.lm_head, labels)
        return out if out.dim() == 0 else -out.float().sum()

    def mtp_embeddings(self, input_ids: torch.Tensor, info: SequenceInfo) -> list[torch.Tensor]:
        """The input embeddings [B, L, H] of each MTP depth: depth ``d`` (0-based) reads the
        token ``d + 1`` ahead (under context parallelism on whole rows, so the last positions
        of a slice read the next rank's tokens)."""
        assert self.backbone.embeddings is not None, "the MTP inputs need the embeddings"
        ids, _, cut = _whole_rows(input_ids, info)
        return [self.backbone.embeddings(shift_left(ids, d + 1, 0)[:, cut])
                for d in range(self.config.num_nextn_predict_layers)]

    # ------------------------------------------------------------------ generation
    def generation_cache_bytes(self, batch_size: int, max_length: int) -> int:
        """Bytes ``generate`` allocates for its decoding state (key/value cache, Mamba states)
        for ``batch_size`` prompts and ``max_length`` positions (prompt + new tokens)."""
        dtype = next(p.dtype for p in self.parameters() if p.is_floating_point())
        return cache_bytes(self.config, batch_size, max_length, dtype)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 pipeline=None, lockstep_group=None, **settings) -> torch.Tensor:
        """Cached decoding (``generation.py``): the prompt [B, L] (left-padded where
        ``attention_mask`` is 0) followed by up to ``max_new_tokens`` new tokens, [B, L + n].
        ``settings``: the fields of ``hybridtrain.ops.sampling.GenerationConfig``
        (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``eos_token_id``, ``seed``: an int, or one per row) with the meaning ``transformers``' ``generate``
        gives them.

        Distributed layouts: ``pipeline`` (``distributed.pipeline_decode.PipelineDecoder``) runs
        this rank's pipeline stages in the chain; ``lockstep_group``: ranks that decode together
        (collectives inside the model) step until all of them are done."""
        return generate(self, input_ids, attention_mask, GenerationConfig(**settings), pipeline=pipeline,
                        lockstep_group=lockstep_group)

    # ------------------------------------------------------------------ Hub I/O
    @classmethod
    def from_pretrained(
        cls,
        local_dir: str | os.PathLike,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> "NemotronHForCausalLM":
        """Load a local Hugging Face checkpoint (single-file or sharded safetensors).

        ``dtype=None`` keeps the dtype stored in the checkpoint. The model is built on the meta
        device and filled tensor by tensor, so only one copy of the weights is ever in memory.
        """
        return load_pretrained(cls, local_dir, dtype=dtype, device=device)

    def save_pretrained(
        self,
        save_dir: str | os.PathLike,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | str | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write a Hugging Face checkpoint (Hub names, per-expert tensors, config.json, index when
        sharded) that ``transformers.NemotronHForCausalLM.from_pretrained`` loads.

        ``dtype``: the dtype to write (e.g. bf16 from fp32 master weights; None: as held).
        ``state_dict``: full tensors to write instead of this module's (e.g. gathered from FSDP
        shards). ``from_pretrained`` records the dtype it read as ``checkpoint_dtype``."""
        save_pretrained(self, save_dir, max_shard_size=max_shard_size, dtype=dtype, state_dict=state_dict)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _whole_rows(x: torch.Tensor, info: SequenceInfo
                ) -> tuple[torch.Tensor, torch.Tensor | None, slice]:
    """(``x`` [B, n] over whole rows, the rows' document ids, this rank's positions of them):
    under context parallelism the ranks' slices gathered, else ``x`` itself."""
    if info.cp is None:
        return x, info.seq_idx, slice(None)
    part = info.cp
    return gather_sequence(x, 1, part.cp), part.seq_idx, slice(part.offset, part.offset + x.shape[1])
