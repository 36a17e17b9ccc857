"""Several continuations of each prompt scored from one prefill of the prompt (Nemotron-H's
``Decoding.score_continuations``): the prompts run once (:func:`.generation.prefill`), each
continuation gets its own copy of its prompt's state (Mamba states and key/value cache,
:meth:`.cache.NemotronHCache.select`) and feeds its tokens one decoding step at a time, all
continuations of the batch together. A multiple-choice question's context is computed once,
not once per answer."""

from __future__ import annotations

import torch

from .generation import decode_step, prefill


@torch.inference_mode()
def score_continuations(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                        rows: torch.Tensor, continuations: torch.Tensor) -> torch.Tensor:
    """fp32 logits [R, n, V]: ``[r, t]`` predicts ``continuations[r, t]`` after the prompt
    ``input_ids[rows[r]]`` (prompts [b, L] left-padded where ``attention_mask`` is 0) and
    ``continuations[r, :t]`` ([R, n]; a row shorter than n is padded on the right with any
    token: the logits past its end mean nothing)."""
    n = continuations.shape[1]
    last, cache = prefill(model, input_ids, attention_mask, max_length=input_ids.shape[1] + n - 1)
    cache = cache.select(rows)
    out = [last.index_select(0, rows)]
    for t in range(n - 1):
        out.append(decode_step(model, cache, continuations[:, t]).clone())
    return torch.stack(out, 1)
