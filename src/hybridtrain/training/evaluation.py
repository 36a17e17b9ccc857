"""Answer quality by generation: the model answers validation prompts with its ``generate``, and
the replies are scored and shown.

* SQuAD exact match and F1 with the official answer normalisation (lower case, punctuation and
  the articles a/an/the removed, whitespace collapsed), each the maximum over all reference
  answers of the record, in percent as the official script prints them (an empty answer scores
  1 only against an empty reference, as in the v2.0 script). A dataset offers references through
  ``reference_answers() -> {record id: [answers]}`` and ``answer_of(completion) -> answer``
  (``data.squad.SquadDataset``); without them only sample replies are written.
* The prompt of a tokenized example is everything up to its first label token, the reference
  its label tokens up to the first unlabelled position; a reply stops at eos or at the
  reference's last token (a chat template's end-of-turn token).

:class:`GenerationEvaluator` runs at every validation of the Trainer (recipe section
``evaluation:``) and in ``hybridtrain evaluate``, under every training layout:

* the data-parallel and context-parallel ranks split the examples (prompts are short: a cp rank
  generates whole sequences, as a data-parallel one); the scores and counts are summed over them;
* FSDP-sharded parameters are gathered for the duration; tensor- and expert-parallel ranks run
  their collectives inside the model's forward, so every rank decodes the same number of
  prompts (fillers, not counted) and steps (the loop ends when all ranks are done);
* under pipeline parallelism the pp ranks decode through their stages in a chain
  (``distributed.pipeline_decode``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import string
import time
from collections import Counter
from typing import Any

import torch
from torch import nn

from hybridtrain.config.recipe import EvaluationSection
from hybridtrain.data.batch import IGNORE_INDEX
from hybridtrain.data.contract import HasReferences, NamesRecords
from hybridtrain.distributed.pipeline_decode import PipelineDecoder
from hybridtrain.ops.sampling import GenerationConfig
from hybridtrain.training.precision import autocast_context

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- SQuAD metrics
_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """The official SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, references: list[str]) -> float:
    return float(max(normalize_answer(prediction) == normalize_answer(r) for r in references))


def _f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, references: list[str]) -> float:
    return max(_f1(prediction, r) for r in references)


# ---------------------------------------------------------------------------------- examples
def prompt_and_reference(input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt tokens, reference tokens) of a tokenized example with shifted labels
    (``labels[t]`` is the target of position ``t``)."""
    first = next((t for t, lab in enumerate(labels) if lab != IGNORE_INDEX), None)
    if first is None:
        raise ValueError("an evaluation example has no label tokens (nothing to answer)")
    ref = []
    for lab in labels[first:]:
        if lab == IGNORE_INDEX:
            break
        ref.append(lab)
    return input_ids[: first + 1], ref


def left_pad(prompts: list[list[int]], pad_id: int, length: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [n, L] of token prompts, padded on the left to ``length``
    (default: the longest prompt)."""
    L = length or max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    return ids, mask


@contextlib.contextmanager
def full_parameters(*models: nn.Module):
    """Every FSDP2-sharded parameter of ``models`` gathered for the duration (generation runs the
    layers piece by piece, not through the sharded modules' forward)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = list({id(m): m for model in models for m in model.modules() if isinstance(m, FSDPModule)}.values())
    for m in sharded:
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.reshard()


# ---------------------------------------------------------------------------------- the evaluator
class GenerationEvaluator:
    """Generates answers for the first ``num_examples`` examples of ``dataset`` and scores them.

    ``__call__(model, step)`` returns the fields added to the validation record (``exact_match``
    and ``f1`` when the dataset has references, ``eval_examples``, ``eval_new_tokens``,
    ``eval_time_s``) and appends ``num_samples`` replies to ``samples_path`` (main rank)."""

    def __init__(self, dataset, tokenizer, *, num_examples: int = 32, max_new_tokens: int = 32,
                 batch_size: int = 8, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, num_samples: int = 4,
                 samples_path: str | None = None, autocast_dtype: torch.dtype | None = None,
                 dims=None, pipeline=None, is_main: bool = True):
        """``dims``: the layout's ParallelDims; ``pipeline``: its PipelineTrainStep under pipeline
        parallelism."""
        if tokenizer is None:
            raise ValueError("evaluation: needs the recipe's tokenizer to read the replies")
        self.dataset, self.tokenizer = dataset, tokenizer
        self.gen_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample,
                               temperature=temperature, top_k=top_k, top_p=top_p)
        GenerationConfig(**self.gen_kwargs)  # out-of-range settings: ValueError at start-up
        self.batch_size, self.seed = batch_size, seed
        self.num_samples, self.samples_path = num_samples, samples_path
        self.autocast_dtype, self.dims, self.is_main = autocast_dtype, dims, is_main
        n = min(num_examples, len(dataset))
        # the ranks holding different data (dp x cp) split the examples
        rank, world = (0, 1) if dims is None else \
            (dims.dp_rank * dims.cp + (dims.cp_rank if dims.cp > 1 else 0), dims.dp * dims.cp)
        self.indices = list(range(rank, n, world))
        self.num_examples = n
        # several ranks: the same number of prompts and of decoding steps on each (collectives
        # inside the forward: FSDP units gather their parameters, tp/ep exchange activations),
        # fillers not counted
        self.lockstep = dims is not None and dims.world_size > 1
        self.fillers = -(-n // world) - len(self.indices) if self.lockstep else 0
        self.pipeline = pipeline
        self.references = dataset.reference_answers() if isinstance(dataset, HasReferences) else None

    def _example(self, i: int) -> tuple[list[int], list[int]]:
        item = self.dataset[i]
        return prompt_and_reference(item["input_ids"].tolist(), item["labels"].tolist())

    def _record_id(self, i: int) -> str:
        return self.dataset.record_id(i) if isinstance(self.dataset, NamesRecords) else str(i)

    def _replies(self, model, prompts, refs, device):
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out = []
        for b in range(0, len(prompts), self.batch_size):
            chunk, rchunk = prompts[b:b + self.batch_size], refs[b:b + self.batch_size]
            ids, mask = left_pad(chunk, pad)
            # a reply ends at eos or at its own reference's last token (e.g. end of turn); the
            # batch stops early only on the ends every row shares
            own = [{self.tokenizer.eos_token_id, r[-1] if r else None} - {None} for r in rchunk]
            shared = sorted(set.intersection(*own)) if own else []
            seqs = model.generate(ids.to(device), attention_mask=mask.to(device), eos_token_id=shared or None,
                                  seed=self.seed + b, **self.gen_kwargs, **self.layout_kwargs())
            for row, stops in zip(seqs[:, ids.shape[1]:].tolist(), own):
                cut = next((i for i, t in enumerate(row) if t in stops), len(row))
                out.append(row[:cut])
        return out

    def layout_kwargs(self) -> dict[str, Any]:
        """What ``model.generate`` needs under this layout (lockstep group, pipeline chain)."""
        kw: dict[str, Any] = {}
        if self.lockstep:
            import torch.distributed as dist

            kw["lockstep_group"] = dist.group.WORLD
        if self.pipeline is not None:
            kw["pipeline"] = PipelineDecoder.of(self.pipeline)
        return kw

    @torch.no_grad()
    def __call__(self, model: nn.Module, step: int) -> dict[str, Any]:
        """(``model`` generates: its spec has a ``Decoding`` part for this layout, which
        ``training.validate.validate_run`` checks before the run is built)"""
        t0 = time.perf_counter()
        device = next(model.parameters()).device
        examples = [self._example(i) for i in self.indices + [0] * self.fillers]
        prompts, refs = [e[0] for e in examples], [e[1] for e in examples]
        was_training = model.training
        model.eval()
        try:
            stages = self.pipeline.stages if self.pipeline is not None else []
            with full_parameters(model, *stages), autocast_context(self.autocast_dtype, device):
                replies = self._replies(model, prompts, refs, device) if prompts else []
        finally:
            model.train(was_training)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in replies]
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # em, f1, examples, new tokens
        samples = []
        for j, (i, text) in enumerate(zip(self.indices, texts)):  # (fillers last: left out)
            sample = {"step": step, "id": self._record_id(i),
                      "prompt": self.tokenizer.decode(prompts[j], skip_special_tokens=True),
                      "reply": text,
                      "reference": self.tokenizer.decode(refs[j], skip_special_tokens=True)}
            if self.references is not None:
                answers = self.references.get(sample["id"]) or [sample["reference"]]
                pred = self.dataset.answer_of(text)
                em, f = exact_match(pred, answers), f1(pred, answers)
                sums[0] += em
                sums[1] += f
                sample.update(answers=answers, exact_match=em, f1=f)
            sums[2] += 1
            sums[3] += len(replies[j])
            samples.append(sample)
        if self.dims is not None:
            self.dims.all_reduce_dp_cp(sums)
        rec: dict[str, Any] = {}
        n = int(sums[2])
        if self.references is not None and n:
            rec["exact_match"] = 100.0 * float(sums[0]) / n
            rec["f1"] = 100.0 * float(sums[1]) / n
        rec.update(eval_examples=n, eval_new_tokens=int(sums[3]), eval_time_s=time.perf_counter() - t0)
        if self.is_main and self.samples_path and self.num_samples:
            os.makedirs(os.path.dirname(os.path.abspath(self.samples_path)), exist_ok=True)
            with open(self.samples_path, "a") as f:
                for s in samples[: self.num_samples]:
                    f.write(json.dumps(s, ensure_ascii=False) + "\n")
        return rec


def evaluator_from_config(section: EvaluationSection, dataset, tokenizer, out_dir: str,
                          **kwargs) -> GenerationEvaluator:
    """The evaluator of a recipe's ``evaluation:`` section (``kwargs``: autocast_dtype, dims,
    is_main)."""
    if dataset is None:
        raise ValueError("evaluation: needs a validation_dataset to answer")
    s = section.to_dict()
    path = s.pop("samples_file")
    return GenerationEvaluator(dataset, tokenizer, samples_path=os.path.join(out_dir, path) if path else None,
                               **s, **kwargs)
