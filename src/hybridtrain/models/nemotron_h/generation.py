"""Cached decoding for Nemotron-H, the loop only: :func:`prefill` runs the prompt once (each
mixer's ``prefill``: the chunked scan with its final state kept, the key/value cache allocated
for the whole generation) and fills a static :class:`~.cache.NemotronHCache`; :func:`decode_step`
feeds one token per row through each mixer's ``step`` (a Mamba2 layer takes one recurrent step,
O(1) work and memory; an attention layer attends over its cache). :func:`generate` is
``NemotronHForCausalLM.generate``.

A step changes no shape and reads no host value (the position is a device tensor), so on CUDA it
is captured once per ``generate`` as a CUDA graph and replayed for every token (:class:`StepGraph`,
chosen by ``ops.backend.decode_graph``): one launch per token instead of hundreds.

Batched prompts are left-padded (``attention_mask`` 0 before each prompt). During prefill the
padding is a document of its own (``seq_idx``): Mamba's conv and scan restart at the prompt and
attention never crosses into or out of it; the conv window kept for decoding holds zeros where
the padding was, and the key/value cache marks those positions invalid. So a padded prompt
decodes as it would alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule

from hybridtrain.distributed.expert_parallel import LocalDispatcher
from hybridtrain.distributed.utils import local_tensor
from hybridtrain.ops import backend
from hybridtrain.ops.sampling import GenerationConfig, decode

from .cache import NemotronHCache
from .moe import Experts, MoE
from .decode_ops import linear, norm, plain_linear


# ---------------------------------------------------------------------------------- model
def _check_model(model) -> None:
    bb = model.backbone
    if bb.embeddings is None or bb.norm_f is None or model.lm_head is None:
        raise ValueError("generate needs the whole model (embeddings, all layers, norm_f, lm_head); "
                         "a pipeline stage generates with its chain (pipeline=...)")
    if len(bb.layers) != model.config.num_hidden_layers:
        raise ValueError(f"generate needs all {model.config.num_hidden_layers} layers; this model holds "
                         f"{len(bb.layers)}")


def _prompt_mask(shape: tuple[int, int], attention_mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """The attention_mask as bool [b, L], None when it has no padding; ValueError unless it is
    left padding with at least one token per row."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(shape)}: they must match")
    valid = attention_mask.to(device=device).bool()
    if bool(valid.all()):
        return None
    if not bool(valid[:, -1].all()):
        raise ValueError("attention_mask: every prompt needs its last position to be a token (0s only as "
                         "left padding before the prompt; pad on the left, e.g. tokenizer.padding_side='left')")
    if bool((valid[:, 1:] < valid[:, :-1]).any()):
        raise ValueError("attention_mask: padding (0) after a token; batched prompts must be left-padded "
                         "(tokenizer.padding_side='left')")
    return valid


def _embed(model, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids embedded, or (a pipeline stage without the embeddings) hidden states as given."""
    emb = model.backbone.embeddings
    return inputs if emb is None else emb(inputs)


def _head(model, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the last position [b, V]; a stage without the head returns ``h`` [b, L, H]."""
    return h if model.lm_head is None else linear(model.lm_head, h[:, -1]).float()


def _step_logits(model, cache: NemotronHCache, h: torch.Tensor) -> torch.Tensor:
    """The LM head of a decoding step, h [b, H] -> fp32 logits [b, V] (against the weight's
    transposed copy where prefill made one and ``b`` is at most ``ops.backend.
    TRANSPOSED_HEAD_MAX_ROWS``: see ``ops.backend.transposed_head``)."""
    if cache.head_t is not None and h.shape[0] <= backend.TRANSPOSED_HEAD_MAX_ROWS and backend.cpu_decode_forms(h):
        return h @ cache.head_t
    return linear(model.lm_head, h).float()


def _transposed_head(model, h: torch.Tensor, steps: int) -> torch.Tensor | None:
    head = model.lm_head
    if (head is not None and plain_linear(head) and head.bias is None and head.weight.dtype == torch.float32
            and backend.transposed_head(h[:, -1], steps)):
        return head.weight.t().contiguous()
    return None


def _run_layers(model, h: torch.Tensor, run_block: Callable, step: bool) -> torch.Tensor:
    """``run_block(name, block, h)`` (the block's ``prefill`` or ``step``) over the blocks held,
    then norm_f (if held). ``step``: a decoding step (``decode_ops.norm``)."""
    for name, block in model.backbone.layers.items():
        h = run_block(name, block, h)
    return h if model.backbone.norm_f is None else norm(model.backbone.norm_f, h, step)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            max_length: int | None = None, inputs_embeds: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, NemotronHCache]:
    """Run the prompt [b, L] (left-padded where ``attention_mask`` is 0) once. Returns the logits
    [b, V] (fp32) of the last position and the cache, with room for ``max_length`` tokens in all
    (default L). A pipeline stage takes and returns what it holds: hidden states [b, L, H] in
    without the embeddings, out without the head."""
    h, cache = prefill_hidden(model, input_ids, attention_mask, max_length, inputs_embeds)
    return _head(model, h), cache


def prefill_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   max_length: int | None = None, inputs_embeds: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, NemotronHCache]:
    """:func:`prefill` returning the final hidden states [b, L, H] of every prompt position
    instead of the last position's logits."""
    h = _embed(model, input_ids) if inputs_embeds is None else inputs_embeds
    b, L = h.shape[:2]
    max_length = L if max_length is None else max_length
    assert max_length >= L, (max_length, L)
    valid = _prompt_mask((b, L), attention_mask, h.device)
    seq_idx = None if valid is None else valid.to(torch.int32)  # padding: document 0, the prompt: 1
    cache_valid = torch.zeros(b, max_length, dtype=torch.bool, device=h.device)
    cache_valid[:, :L] = True if valid is None else valid
    cache = NemotronHCache(valid=cache_valid, position=torch.tensor([L], device=h.device), length=L)

    def run_block(name, block, x):
        y, entry = block.prefill(x, seq_idx, valid, max_length)
        if entry is not None:
            cache.layers[name] = entry
        return y

    h = _run_layers(model, h, run_block, step=False)
    cache.head_t = _transposed_head(model, h, max_length - L)
    return h, cache


def _step(model, cache: NemotronHCache, tokens: torch.Tensor) -> torch.Tensor:
    """One decoding step on the static cache, all on the device (what :class:`StepGraph`
    captures): feeds ``tokens`` [b] (a stage without the embeddings: hidden states [b, 1, H]) at
    ``cache.position``, advances it, returns the next logits [b, V] fp32 (or the stage's hidden
    states)."""
    cache.valid.index_fill_(1, cache.position, True)

    def run_block(name, block, x):
        return block.step(x, cache.layers.get(name), cache.valid, cache.position)

    h = _embed(model, tokens[:, None] if tokens.dim() == 1 else tokens)
    h = _run_layers(model, h, run_block, step=True)
    cache.position += 1
    return h if model.lm_head is None else _step_logits(model, cache, h[:, 0])


@torch.no_grad()
def decode_step(model, cache: NemotronHCache, tokens: torch.Tensor, graph: "StepGraph | None" = None
                ) -> torch.Tensor:
    """Feed one token per row (tokens [b]); returns the next logits [b, V] (fp32). A pipeline
    stage takes hidden states [b, 1, H] without the embeddings, returns them without the head.
    ``graph``: the step captured for this cache (its output buffer is returned: valid until
    the next step)."""
    if cache.length >= cache.max_length:
        raise ValueError(f"the cache holds {cache.max_length} tokens and is full; prefill with a larger max_length")
    out = _step(model, cache, tokens) if graph is None else graph(tokens)
    cache.length += 1
    return out


# ---------------------------------------------------------------------------------- CUDA graph
Capture = Callable[[Callable[[], torch.Tensor], Callable[[], None], int], tuple[Callable[[], None], torch.Tensor]]


def cuda_graph_capture(step: Callable[[], torch.Tensor], restore: Callable[[], None], warmup: int
                       ) -> tuple[Callable[[], None], torch.Tensor]:
    """``step`` run ``warmup`` times on a side stream (each followed by ``restore``, which puts
    back the state it changed), then captured as a CUDA graph: returns (replay, the output
    tensor every replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
            restore()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph.replay, out


def compiled_capture(step: Callable[[], torch.Tensor], restore: Callable[[], None], warmup: int,
                     backend: str = "aot_eager") -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for :func:`cuda_graph_capture` on any device (tests, a benchmark's CPU dry
    run): ``step`` compiled whole (``fullgraph``: no graph break, no host sync), warmed up, and
    replayed under a stance that fails on any recompilation, so a replay may depend on no host
    value, as a CUDA graph's. (Its capture runs the step: the caller restores after it.)"""
    compiled = torch.compile(step, fullgraph=True, backend=backend, dynamic=False)
    for _ in range(warmup):
        compiled()
        restore()
    out = compiled()

    def replay():
        with torch.compiler.set_stance("fail_on_recompile"):
            out.copy_(compiled())

    return replay, out


class StepGraph:
    """The decoding steps of one cache as one captured graph: the step reads its tokens from a
    static buffer and the static cache, writes the logits to a static output, so each token is
    a copy into the buffer and a replay. The warm-up runs that capture needs change the cache;
    it is restored after each (a step needs room for one token only). ``capture`` (default
    :func:`cuda_graph_capture`) is a parameter so that the same logic runs on CPU under a
    compiled stand-in (:func:`compiled_capture`)."""

    def __init__(self, model, cache: NemotronHCache, tokens: torch.Tensor, capture: Capture = cuda_graph_capture,
                 warmup: int = 2):
        self.tokens = torch.zeros_like(tokens)
        saved = [t.clone() for t in cache.mutable_tensors()]

        def restore():
            for t, s in zip(cache.mutable_tensors(), saved):
                t.copy_(s)

        self.replay, self.out = capture(lambda: _step(model, cache, self.tokens), restore, warmup)
        restore()

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.replay()
        return self.out


def graph_decodable(model, device: torch.device) -> bool:
    """Whether ``ops.backend`` captures decoding on ``device`` and the model's step can be
    captured: local experts, plain (not tensor-parallel or sharded) parameters, no FSDP2 unit
    (whose hooks would run inside the capture)."""
    return (backend.decode_graph(device)
            and not any(isinstance(m, FSDPModule) for m in model.modules())
            and all(type(m.experts) is Experts and type(m.token_dispatcher) is LocalDispatcher
                    for m in model.modules() if isinstance(m, MoE))
            and all(local_tensor(p) is p for p in model.parameters()))


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: GenerationConfig,
             pipeline=None, lockstep_group=None) -> torch.Tensor:
    """See ``NemotronHForCausalLM.generate``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if pipeline is None:
        _check_model(model)
        models = [model]
    else:
        models = pipeline.stages
    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        max_length = input_ids.shape[1] + config.max_new_tokens
        if pipeline is None:
            cache: list[NemotronHCache] = []

            def first():
                logits, c = prefill(model, input_ids, attention_mask, max_length=max_length)
                cache.append(c)
                return logits

            use_graph = lockstep_group is None and graph_decodable(model, input_ids.device)
            graph: list[StepGraph] = []

            def step(tok):
                if use_graph and not graph:
                    graph.append(StepGraph(model, cache[0], tok))
                return decode_step(model, cache[0], tok, graph[0] if graph else None)

            def run():
                return decode(first, step, input_ids, config, lockstep_group=lockstep_group)
        else:
            caches: dict[int, NemotronHCache] = {}

            def stage_prefill(i, stage, x):
                out, caches[i] = prefill(stage, x, attention_mask, max_length=max_length)
                return out

            def run():
                return decode(lambda: pipeline.run(stage_prefill, input_ids),
                              lambda tok: pipeline.run(lambda i, stage, x: decode_step(stage, caches[i], x), tok),
                              input_ids, config, share_tokens=pipeline.share_tokens,
                              lockstep_group=lockstep_group)
        # inference mode: no version counters or views tracking for the step's few hundred
        # small ops (batch 1: 8 % less CPU time per step); the tokens leave it as a plain tensor
        with torch.inference_mode():
            out = run()
        return out.clone()
    finally:
        for m, t in zip(models, was_training):
            m.train(t)
