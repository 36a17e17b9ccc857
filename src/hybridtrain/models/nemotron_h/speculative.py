"""Self-speculative greedy decoding with the model's multi-token prediction (MTP) layers as the
draft (``hybridtrain generate --speculative mtp``).

One round, with the committed tokens ``x_0..x_n`` (``x_n`` the newest, not yet fed to the main
model, whose cache holds positions ``0..n-1`` and whose final hidden states ``h_t`` are known):

1. **Draft.** The first MTP depth is a small causal model over positions: at ``t`` it reads
   ``fuse(embed(x_{t+1}), h_t)``. It catches up over the committed positions it has not seen
   (with the main model's hidden states), which drafts ``d_1`` at ``n-1``; then it runs on ahead,
   each step reading its own previous output as the hidden state and its last draft as the
   token (as vLLM drafts ``k`` tokens from Nemotron-H's one MTP depth), for ``d_2..d_k``. Its
   cache then rolls back to position ``n-1``: the positions it ran ahead on are redone next
   round with the main model's hidden states.
2. **Verify.** The main model runs one forward over ``[x_n, d_1..d_k]``
   (:meth:`.blocks.Block.verify`): each attention layer attends with the key/value cache and
   the ``k + 1`` new keys (causal among them), each Mamba layer projects the ``k + 1`` tokens at
   once and runs its recurrence over them from the cached conv/SSM state (keeping the state
   after each token), MLP and MoE take the ``k + 1`` tokens as one batch. The same operations
   as plain decoding on more rows: the logits agree with plain decoding's to float rounding
   (a matrix product over ``k + 1`` rows may sum in another order than over one), and the
   accepted tokens are the main model's greedy tokens under these logits.
3. **Accept.** The longest prefix of drafts equal to the main model's greedy tokens, plus the
   main model's next token. The key/value caches roll back by marking the rejected positions
   invalid and moving the position back (they are rewritten later); each Mamba layer's conv
   window and SSM state go back to the copies kept after the last accepted token.

Batch size 1 (each prompt decodes on its own); greedy, or sampled at a temperature with
speculative sampling's acceptance (:func:`speculative_accept`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridtrain.ops.sampling import select_tokens

from .cache import MambaState, NemotronHCache
from .decode_ops import norm
from .generation import _head, _step_logits, _transposed_head, prefill_hidden


@dataclass
class SpeculativeStats:
    """``drafted``: draft tokens proposed; ``accepted``: those the main model agreed with;
    ``rounds``: main-model verification passes."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def _snapshot(cache: NemotronHCache) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (s.conv.clone(), s.ssm.clone()) for n, s in cache.layers.items() if isinstance(s, MambaState)}


def _restore(cache: NemotronHCache, saved: dict, position: int) -> None:
    """The cache as it was after ``position`` tokens: Mamba states from ``saved``, key/value
    positions from ``position`` on invalid."""
    for n, (conv, ssm) in saved.items():
        cache.layers[n].conv.copy_(conv)
        cache.layers[n].ssm.copy_(ssm)
    cache.valid[:, position:] = False
    cache.position.fill_(position)
    cache.length = position


def _run_tokens(layers, cache: NemotronHCache, h: torch.Tensor, keep_states: bool
                ) -> tuple[torch.Tensor, list[dict]]:
    """``h`` [1, T, H] (positions ``cache.length``..) through ``layers`` (name -> block), one
    forward over the ``T`` tokens per layer (:meth:`.blocks.Block.verify`); returns the outputs
    [1, T, H] and, with ``keep_states``, each token's Mamba states after it (for the rollback)."""
    start, T = cache.length, h.shape[1]
    states: list[dict] = [{} for _ in range(T)]
    for name, block in layers.items():
        h, per_token = block.verify(h, cache.layers.get(name), cache.valid, start)
        if keep_states:
            for i, state in enumerate(per_token):
                states[i][name] = state
    cache.valid[:, start:start + T] = True
    cache.position.fill_(start + T)
    cache.length = start + T
    return h, states


class MTPDraft:
    """The first MTP depth as a draft model over positions (see the module docstring)."""

    def __init__(self, model, prompt_ids: torch.Tensor, hidden: torch.Tensor, main_cache: NemotronHCache):
        """``hidden``: the main model's final hidden states over the prompt; ``main_cache``: its
        cache after the prompt (the draft's cache is as long; the head's transposed copy, where
        prefill made one, is shared)."""
        self.model = model
        max_length = main_cache.max_length
        layers = model.mtp.depth(0)
        self.layers = {str(i): layer for i, layer in enumerate(layers)}
        # prefill over the prompt positions 0..L-2 (each reads the next prompt token)
        emb = model.backbone.embeddings(prompt_ids[:, 1:])
        x = layers[0].fuse(hidden[:, :-1], emb)
        self.cache = NemotronHCache(valid=torch.zeros(1, max_length, dtype=torch.bool, device=x.device),
                                    position=torch.tensor([0], device=x.device), length=0,
                                    head_t=main_cache.head_t)
        if x.shape[1]:
            self.cache.valid[:, :x.shape[1]] = True
            self.cache.position.fill_(x.shape[1])
            self.cache.length = x.shape[1]
            for name, layer in self.layers.items():
                x, entry = layer.prefill(x, None, None, max_length)
                if entry is not None:
                    self.cache.layers[name] = entry

    def _run(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Steps at the next positions reading (hidden [1, T, H], tokens [1, T]); the last
        position's output [1, 1, H] (after the depth's final norm)."""
        first = next(iter(self.layers.values()))
        x = first.fuse(hidden, self.model.backbone.embeddings(tokens))
        x, _ = _run_tokens(self.layers, self.cache, x, keep_states=False)
        last = list(self.layers.values())[-1]
        return norm(last.final_layernorm, x[:, -1:])

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int) -> list[int]:
        """Catch up over the committed positions (``hidden`` [1, T, H]: the main model's at the
        positions not seen yet, ``tokens`` [1, T]: the token after each), then ``k`` greedy
        drafts; the cache keeps only the caught-up positions."""
        return self._propose(hidden, tokens, k, lambda logits: (int(select_tokens(logits, False)[0]), None))[0]

    def sample(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int, temperature: float,
               generator: torch.Generator | None) -> tuple[list[int], torch.Tensor]:
        """:meth:`draft` with ``k`` drafts drawn from the draft's softmax at ``temperature``;
        returns also those distributions q [k, V]."""
        def pick(logits):
            q = (logits.float() / temperature).softmax(-1)
            return int(torch.multinomial(q, 1, generator=generator)[0, 0]), q[0]

        drafts, qs = self._propose(hidden, tokens, k, pick)
        return drafts, torch.stack(qs)

    def _propose(self, hidden, tokens, k, pick) -> tuple[list[int], list]:
        m = self._run(hidden, tokens)
        keep, saved = self.cache.length, _snapshot(self.cache)
        drafts, qs = [], []
        for i in range(k):
            token, q = pick(_step_logits(self.model, self.cache, m[:, 0]))
            drafts.append(token)
            qs.append(q)
            if i < k - 1:
                m = self._run(m, torch.tensor([[token]], device=tokens.device))
        _restore(self.cache, saved, keep)
        return drafts, qs


def speculative_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's acceptance (Leviathan et al. 2023; Chen et al. 2023) of ``k``
    drafts per row: ``p`` [b, k + 1, V] the main model's probabilities at the drafts' positions
    and one after, ``q`` [b, k, V] the draft's, ``drafts`` [b, k] drawn from ``q``. Draft ``i`` is
    kept with probability min(1, p/q) while all before it were; at the first rejection the next
    token is drawn from normalize(max(0, p - q)) there, else (all kept) from ``p`` after the
    last. Returns the accepted counts [b] and the next tokens [b]: every kept token and the next
    one are distributed as sampling from ``p`` token by token."""
    b, k = drafts.shape
    rows = torch.arange(b, device=p.device)[:, None]
    cols = torch.arange(k, device=p.device)
    pd, qd = p[rows, cols, drafts], q[rows, cols, drafts]  # [b, k]
    u = torch.rand(b, k, generator=generator, device=p.device)
    ok = u * qd < pd  # u < p/q without dividing (q(d) > 0: d was drawn from q)
    accepted = ok.int().cumprod(-1).sum(-1)  # [b]
    at = accepted.clamp(max=k - 1)
    residual = (p[rows[:, 0], at, :] - q[rows[:, 0], at, :]).clamp(min=0)
    dist = torch.where((accepted < k)[:, None], residual, p[:, k])
    # a residual of all zeros (p == q to rounding) has no rejection to resample: draw from p
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, p[rows[:, 0], accepted])
    return accepted, torch.multinomial(dist, 1, generator=generator)[:, 0]


@torch.no_grad()
def speculative_generate(model, input_ids: torch.Tensor, max_new_tokens: int, draft_tokens: int = 3,
                         eos_token_id: int | list[int] | None = None, drafter=MTPDraft,
                         temperature: float | None = None, seed: int | None = None
                         ) -> tuple[torch.Tensor, SpeculativeStats]:
    """Greedy decoding of one prompt [1, L] drafted by the MTP layers; returns the prompt and
    the new tokens [1, L + n] (as ``generate`` with ``do_sample=False``) and the statistics.
    ``drafter(model, input_ids, prompt_hidden, main_cache)``: the draft model (an object with
    :meth:`MTPDraft.draft`'s signature, and :meth:`MTPDraft.sample`'s when sampling).
    ``temperature`` > 0: speculative sampling instead (:func:`speculative_accept`), the tokens
    distributed as ``generate(do_sample=True, temperature=...)``'s (not the same draws), drawn
    from a generator seeded with ``seed`` (None: torch's global one)."""
    if model.mtp is None:
        raise ValueError("--speculative mtp: the model has no multi-token prediction layers "
                         "(config.json's num_nextn_predict_layers is 0)")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one prompt [1, L]; got shape {tuple(input_ids.shape)}")
    if draft_tokens < 1:
        raise ValueError(f"--draft-tokens must be >= 1, got {draft_tokens}")
    sampling = temperature is not None and temperature > 0
    gen = None
    if sampling and seed is not None:
        gen = torch.Generator(device=input_ids.device).manual_seed(seed)
    stats = SpeculativeStats()
    if max_new_tokens == 0:
        return input_ids, stats
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
    was_training = model.training
    model.eval()
    try:
        # inference mode, as plain decoding: no version counters or view tracking for a
        # round's few hundred small ops; the tokens leave it as a plain tensor
        with torch.inference_mode():
            ids = _speculative_loop(model, input_ids, max_new_tokens, draft_tokens, eos, drafter,
                                    sampling, temperature, gen, stats)
        return ids.clone(), stats
    finally:
        model.train(was_training)


def _speculative_loop(model, input_ids, max_new_tokens, draft_tokens, eos, drafter, sampling,
                      temperature, gen, stats) -> torch.Tensor:
    """:func:`speculative_generate`'s rounds (see the module docstring)."""
    L = input_ids.shape[1]
    max_length = L + max_new_tokens + draft_tokens + 1
    hidden, cache = prefill_hidden(model, input_ids, None, max_length)
    cache.head_t = _transposed_head(model, hidden, max_new_tokens)  # as plain decoding chooses
    out = [int(select_tokens(_head(model, hidden), sampling, temperature or 1.0, generator=gen)[0])]
    drafter = drafter(model, input_ids, hidden, cache)
    pending_h = hidden[:, -1:]  # the main hidden states the draft has not read, and
    pending_t = [out[0]]  # the token after each
    bb = model.backbone
    while len(out) < max_new_tokens and out[-1] not in eos:
        k = min(draft_tokens, max_new_tokens - len(out))
        committed = torch.tensor([pending_t], device=input_ids.device)
        if sampling:
            drafts, q = drafter.sample(pending_h, committed, k, temperature, gen)
        else:
            drafts = drafter.draft(pending_h, committed, k)
        # verify: the newest token and the drafts through the main model, once
        start = cache.length
        tokens = torch.tensor([[out[-1]] + drafts], device=input_ids.device)
        h, states = _run_tokens(bb.layers, cache, bb.embeddings(tokens), keep_states=True)
        logits = _step_logits(model, cache, norm(bb.norm_f, h[0]))  # [k + 1, V]
        if sampling:
            accepted, nxt = speculative_accept((logits / temperature).softmax(-1)[None], q[None],
                                               torch.tensor([drafts], device=logits.device), gen)
            a = int(accepted[0])
            new = drafts[:a] + [int(nxt[0])]  # (an accepted eos ends the output below)
        else:
            greedy = select_tokens(logits, False).tolist()
            a = 0
            while a < k and drafts[a] == greedy[a] and drafts[a] not in eos:
                a += 1
            new = drafts[:a] + [greedy[a]]
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += a
        _restore(cache, states[a], start + a + 1)  # keep [x_n, d_1..d_a]
        pending_h, pending_t = h[:, :a + 1], new
        for t in new:
            out.append(t)
            if t in eos or len(out) == max_new_tokens:
                break
    new_ids = torch.tensor([out], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, new_ids], dim=1)


def speculative_decode(model, input_ids: torch.Tensor, max_new_tokens: int, draft_tokens: int,
                       eos_token_id=None, temperature: float | None = None, seed: int | None = None
                       ) -> tuple[torch.Tensor, dict]:
    """The spec's ``Decoding.speculative``: :func:`speculative_generate` with its statistics as
    a dict."""
    ids, stats = speculative_generate(model, input_ids, max_new_tokens, draft_tokens, eos_token_id,
                                      temperature=temperature, seed=seed)
    return ids, {"drafted": stats.drafted, "accepted": stats.accepted,
                 "acceptance_rate": stats.acceptance_rate}
