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
                        rows: torch.Tensor, continuations: torch.Tensor, lengths: list[int]
                        ) -> torch.Tensor:
    """fp32 logits [R, n, V]: ``[r, t]`` predicts ``continuations[r, t]`` after the prompt
    ``input_ids[rows[r]]`` (prompts [b, L] left-padded where ``attention_mask`` is 0) and
    ``continuations[r, :t]`` ([R, n], right-padded to n). ``lengths``: the tokens of each
    continuation, longest first; a row stops stepping past its length (its logits there are 0)."""
    R, n = continuations.shape
    assert list(lengths) == sorted(lengths, reverse=True) and lengths[0] == n, (lengths, n)
    last, cache = prefill(model, input_ids, attention_mask, max_length=input_ids.shape[1] + n - 1)
    cache = cache.select(rows)
    out = last.new_zeros(R, n, last.shape[-1])
    out[:, 0] = last.index_select(0, rows)
    for t in range(n - 1):
        active = sum(m > t + 1 for m in lengths)  # the rows still to score, a prefix
        step_cache = cache if active == R else cache.head(active)
        out[:active, t + 1] = decode_step(model, step_cache, continuations[:active, t])
        cache.length = step_cache.length
    return out
