"""Token selection and the decoding loop of ``generate``, for any model that offers a prefill and
a one-token step (the model keeps its own cache).

The arguments mean what they mean in ``transformers``' ``generate``: greedy (argmax) unless
``do_sample``; when sampling, the logits are divided by ``temperature``, then only the ``top_k``
largest are kept (0: all), then the smallest set of tokens whose probability reaches ``top_p``
(1.0: all; at least one token), and the next token is drawn from the softmax. A sequence stops
at any of ``eos_token_id`` and is padded with the first eos id afterwards; the loop ends when
every sequence has stopped or after ``max_new_tokens``. ``seed`` seeds a generator of its own
(None: torch's global one), so a seeded call draws the same tokens as ``torch.manual_seed(seed)``
before ``transformers``' ``generate`` on the same logits; a list of seeds, one per row, gives
each row a generator of its own, so a row's draws do not depend on the other rows of the batch
(e.g. rollouts split over ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GenerationConfig:
    """The settings of one ``generate`` call (checked on construction: ValueError naming the
    argument that is out of range)."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_id: int | Sequence[int] | None = None
    seed: int | Sequence[int] | None = None  # one per row: each row draws from its own generator

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.do_sample and not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature must be a number > 0 when sampling, got {self.temperature!r} "
                             "(use do_sample=False for greedy decoding)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no top-k filtering), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be a number in [0, 1] (1.0: no nucleus filtering), got {self.top_p!r}")

    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
                  ) -> torch.Tensor:
    """Temperature, then top-k, then top-p on logits [b, V] (fp32): filtered entries are -inf."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p)
        drop[..., -1:] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    return scores


def select_tokens(logits: torch.Tensor, do_sample: bool, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0,
                  generator: torch.Generator | Sequence[torch.Generator] | None = None
                  ) -> torch.Tensor:
    """The next token of each row of logits [b, V]: argmax, or a draw from the filtered softmax
    (``generator``: one for the batch, or one per row)."""
    if not do_sample:
        return logits.argmax(-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    if isinstance(generator, Sequence):
        return torch.cat([torch.multinomial(p[None], 1, generator=g)[0] for p, g in zip(probs, generator)])
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def all_finished(unfinished: torch.Tensor, group=None) -> bool:
    """Whether no row of ``unfinished`` [b] is still generating; with ``group`` (ranks that must
    run the same forward calls: collectives inside the model) on every rank of the group."""
    done = torch.tensor([0 if bool(unfinished.any()) else 1], dtype=torch.int32, device=unfinished.device)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=group)
    return bool(done.item())
def _generators(seed: int | Sequence[int] | None, rows: int, device
                ) -> torch.Generator | list[torch.Generator] | None:
    if seed is None:
        return None
    if isinstance(seed, Sequence):
        if len(seed) != rows:
            raise ValueError(f"seed: one seed per row expected, got {len(seed)} for {rows} rows")
        return [torch.Generator(device=device).manual_seed(int(s)) for s in seed]
    return torch.Generator(device=device).manual_seed(int(seed))


def decode(
    prefill: Callable[[], torch.Tensor | None],
    step: Callable[[torch.Tensor], torch.Tensor | None],
    input_ids: torch.Tensor,
    config: GenerationConfig,
    *,
    share_tokens: Callable[[torch.Tensor | None], torch.Tensor] | None = None,
    lockstep_group=None,
) -> torch.Tensor:
    """The decoding loop: ``prefill()`` returns the logits [b, V] after the prompt, ``step(tokens
    [b])`` feeds one token per row and returns the next logits. Returns the prompt followed by the
    new tokens, [b, prompt length + n] with n <= max_new_tokens.

    A pipeline's ranks other than the last stage's get None logits: ``share_tokens(tokens or
    None)`` returns the last stage's tokens on every rank. ``lockstep_group``: the loop ends only
    when every rank of it has finished (each runs the same number of steps)."""
    c = config
    out = [input_ids]
    if c.max_new_tokens == 0:
        return input_ids
    eos = None
    if c.eos_token_id is not None:
        eos = torch.tensor(c.eos_ids(), dtype=input_ids.dtype, device=input_ids.device)
    gen = _generators(c.seed, input_ids.shape[0], input_ids.device) if c.do_sample else None
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    logits = prefill()
    for i in range(c.max_new_tokens):
        nxt = None if logits is None else select_tokens(logits, c.do_sample, c.temperature, c.top_k, c.top_p, gen)
        if share_tokens is not None:
            nxt = share_tokens(nxt)
        nxt = nxt.to(input_ids.dtype)
        if eos is not None:
            nxt = torch.where(unfinished, nxt, eos[0])
            unfinished &= ~torch.isin(nxt, eos)
        out.append(nxt[:, None])
        if i == c.max_new_tokens - 1:
            break
        # (without eos and lockstep ranks no row can finish early: no host sync per step)
        if (eos is not None or lockstep_group is not None) and all_finished(unfinished, lockstep_group):
            break
        logits = step(nxt)
    return torch.cat(out, dim=1)
