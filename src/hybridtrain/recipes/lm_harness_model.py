"""hybridtrain's model as an lm-evaluation-harness model, registered as ``hybridtrain`` in
lm_eval's model registry when this module is imported (``hybridtrain lm-eval`` imports it).

Tokenization is lm_eval's own (:class:`lm_eval.api.model.TemplateLM`, as its ``hf`` backend
encodes); log-likelihoods come from packed prefills (several requests in one row, separated by
``cu_seqlens``: no padding computed); generation from the model's cached decoding (``generate``:
Mamba states and a key/value cache). ``pretrained``: a Hugging Face folder, a run folder or a
``step_N`` checkpoint (a distributed checkpoint without an export is read as it is);
``adapter``: a PEFT adapter applied on top.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import _add_special_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from hybridtrain.recipes.generate import open_model
from hybridtrain.training.evaluation import left_pad


def _pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Request indices in groups whose lengths sum to at most ``budget`` (a longer request alone),
    longest first, so that each packed row is about full."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    used = budget
    for i in order:
        if used + lengths[i] > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += lengths[i]
    return groups


@register_model("hybridtrain")
class HybridtrainLM(TemplateLM):
    """``lm_eval --model hybridtrain --model_args pretrained=DIR[,adapter=DIR,dtype=float32,
    device=cuda,max_batch_tokens=8192,max_length=4096]``; ``batch_size``: prompts generated
    together."""

    def __init__(self, pretrained: str, adapter: str | None = None, dtype: str | None = None,
                 device: str | None = None, batch_size: int | str = 8,
                 max_batch_tokens: int = 8192, max_length: int = 4096, **_: Any):
        super().__init__()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded = open_model(str(pretrained), adapter, dtype, device, "pretrained")
        self.model, self.tokenizer = loaded.model.eval(), loaded.tokenizer
        self._device = torch.device(device)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_length = int(max_length)

    # -- tokens (as lm_eval's hf backend) -------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any
                   ) -> list[int]:
        return self.tokenizer.encode(string, **_add_special_kwargs(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- log-likelihoods: packed prefills -------------------------------------------------------
    @torch.no_grad()
    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log-probs of ``continuation``, whether it is the greedy one) per
        ``(context, continuation)`` token row, several rows per forward."""
        inputs = [(ctx + cont)[-(self.max_length + 1):][:-1] for ctx, cont in rows]
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        for group in _pack([len(x) for x in inputs], self.max_batch_tokens):
            lengths = torch.tensor([len(inputs[i]) for i in group])
            ends = lengths.cumsum(0)
            ids = torch.tensor([t for i in group for t in inputs[i]], device=self.device)
            positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(self.device)
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(self.device, torch.int32)
            logits = self.model(ids[None], position_ids=positions[None], cu_seqlens=cu)[0]
            for i, end in zip(group, ends.tolist()):
                cont = torch.tensor(rows[i][1], device=self.device)
                logp = logits[end - len(cont):end].float().log_softmax(-1)
                picked = logp.gather(-1, cont[:, None])
                out[i] = (float(picked.sum()), bool((logp.argmax(-1) == cont).all()))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_: Any
                              ) -> list[tuple[float, bool]]:
        results = self._score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(ll for ll, _ in self._score(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # -- generation: cached decoding ------------------------------------------------------------
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = [r.args for r in requests]
        out: list[str] = [""] * len(args)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.eot_token_id
        for start in tqdm(range(0, len(args), self.batch_size), disable=disable_tqdm):
            batch = list(range(start, min(start + self.batch_size, len(args))))
            for kw, rows in self._by_settings(args, batch).items():
                settings = dict(kw)
                until = list(settings.pop("until"))
                new = settings.pop("max_gen_toks")
                prompts = [self.tok_encode(args[i][0])[-(self.max_length - new):] for i in rows]
                ids, mask = left_pad(prompts, pad)
                seqs = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                           max_new_tokens=new, eos_token_id=[self.eot_token_id],
                                           **settings)
                for i, row in zip(rows, seqs[:, ids.shape[1]:].tolist()):
                    if self.eot_token_id in row:  # the rest is padding
                        row = row[:row.index(self.eot_token_id)]
                    text = self.tok_decode(row)
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", args[i], text)
        return out

    def _by_settings(self, args, rows: list[int]) -> dict[tuple, list[int]]:
        """Rows grouped by their generation settings (``until``, ``max_gen_toks``, sampling)."""
        groups: dict[tuple, list[int]] = {}
        for i in rows:
            kw = dict(args[i][1])
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            greedy = kw.get("temperature", 1.0) == 0  # lm_eval's spelling of greedy
            key = (("until", tuple(until)), ("max_gen_toks", int(kw.pop("max_gen_toks", 256))),
                   ("do_sample", bool(kw.pop("do_sample", False)) and not greedy),
                   *((k, kw[k]) for k in ("temperature", "top_k", "top_p") if k in kw and not greedy))
            groups.setdefault(key, []).append(i)
        return groups
