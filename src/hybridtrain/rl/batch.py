"""The RL batch (NeMo-RL's keys, tensors indexed by input position) and how a Policy lays it out.

* :func:`prepare` checks and completes a batch (``input_lengths``, ``token_mask``,
  ``sample_mask`` defaults; ``token_mask`` zeroed past each row's length);
* :func:`global_counts`: ``(Σ sample_mask, Σ token_mask[:, 1:]·sample_mask)`` of the global batch;
* :func:`pad_rows`, :func:`take_rows`: dummy rows (``sample_mask`` 0) up to a multiple, row slices;
* :func:`model_rows` / :func:`unpack`: a micro-batch's rows as model inputs (next-token
  ``labels``; with packing, all rows concatenated into one row whose documents restart their
  positions, targets never crossing a document) and the model's per-position outputs back to
  ``[rows, S, ...]``.
"""

from __future__ import annotations

import torch

from hybridtrain.data.batch import IGNORE_INDEX

__all__ = ["ROW_KEYS", "prepare", "global_counts", "pad_rows", "take_rows", "model_rows", "unpack",
           "next_token_labels"]

# per-token float tensors [B, S] (indexed by input position)
TOKEN_KEYS = ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
ROW_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask") + TOKEN_KEYS


def prepare(batch: dict, device: torch.device | str | None = None) -> dict:
    """A checked copy of ``batch`` on ``device``: ``input_lengths`` default ``S``; ``sample_mask``
    default ones; ``token_mask`` default ones, zeroed from each row's length on."""
    if "input_ids" not in batch:
        raise ValueError("the batch has no input_ids ([B, S] token ids)")
    ids = torch.as_tensor(batch["input_ids"])
    if ids.dim() != 2 or ids.dtype.is_floating_point:
        raise ValueError(f"batch['input_ids'] must be [B, S] integer ids, got {tuple(ids.shape)} "
                         f"{ids.dtype}")
    B, S = ids.shape
    if S < 2:
        raise ValueError(f"batch['input_ids'] has {S} column(s); next-token log-probs need S >= 2")
    out = {"input_ids": ids.to(device, torch.long)}
    lengths = batch.get("input_lengths")
    lengths = torch.full((B,), S) if lengths is None else torch.as_tensor(lengths)
    if lengths.shape != (B,) or bool((lengths < 1).any()) or bool((lengths > S).any()):
        raise ValueError(f"batch['input_lengths'] must be [B] = [{B}] values in 1..{S}, got "
                         f"{lengths.tolist() if lengths.numel() <= 16 else tuple(lengths.shape)}")
    out["input_lengths"] = lengths.to(device, torch.long)
    valid = torch.arange(S, device=device)[None] < out["input_lengths"][:, None]
    tm = batch.get("token_mask")
    tm = torch.ones(B, S) if tm is None else torch.as_tensor(tm)
    sm = batch.get("sample_mask")
    sm = torch.ones(B) if sm is None else torch.as_tensor(sm)
    for key, t, shape in (("token_mask", tm, (B, S)), ("sample_mask", sm, (B,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"batch[{key!r}] must have shape {list(shape)}, got {list(t.shape)}")
    out["token_mask"] = tm.to(device, torch.float32) * valid
    out["sample_mask"] = sm.to(device, torch.float32)
    for key in TOKEN_KEYS:
        if batch.get(key) is not None:
            t = torch.as_tensor(batch[key])
            if tuple(t.shape) != (B, S):
                raise ValueError(f"batch[{key!r}] must be [B, S] = [{B}, {S}] (indexed by input "
                                 f"position, like input_ids), got {list(t.shape)}")
            out[key] = t.to(device, torch.float32)
    return out


def global_counts(batch: dict) -> tuple[float, float]:
    """(global_valid_seqs, global_valid_toks) of a prepared global batch."""
    sm = batch["sample_mask"]
    return float(sm.sum()), float((batch["token_mask"][:, 1:] * sm[:, None]).sum())


def pad_rows(batch: dict, multiple: int) -> dict:
    """Dummy rows (one token, masks 0) appended until the row count is a multiple of ``multiple``."""
    B = batch["input_ids"].shape[0]
    extra = -B % multiple
    if not extra:
        return batch
    out = {}
    for k, v in batch.items():
        fill = 1 if k == "input_lengths" else 0
        out[k] = torch.cat([v, v.new_full((extra,) + tuple(v.shape[1:]), fill)])
    return out


def take_rows(batch: dict, start: int, end: int) -> dict:
    return {k: v[start:end] for k, v in batch.items()}


def next_token_labels(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``labels[:, t] = input_ids[:, t+1]`` while ``t+1 < length``, else ``IGNORE_INDEX``."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    pos = torch.arange(input_ids.shape[1], device=input_ids.device)
    return labels.masked_fill(pos[None] + 1 >= lengths[:, None], IGNORE_INDEX)


def model_rows(rows: dict, packed: bool, pad_to_multiple_of: int = 1) -> dict:
    """Model inputs of a micro-batch: ``input_ids``, ``labels`` (and ``position_ids`` when
    ``packed``). Unpacked: the rows cut to their longest length. Packed: one row of every row's
    valid tokens, each a document (positions restart, its last token has no target), padded to a
    multiple of ``pad_to_multiple_of`` with a label-free document."""
    ids, lengths = rows["input_ids"], rows["input_lengths"]
    if not packed:
        L = int(lengths.max())
        ids = ids[:, :L]
        return {"input_ids": ids, "labels": next_token_labels(ids, lengths)}
    labels = next_token_labels(ids, lengths)
    n = [int(x) for x in lengths]
    keep = torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]
    pos = torch.cat([torch.arange(k, device=ids.device) for k in n])
    flat_ids, flat_labels = ids[keep], labels[keep]
    pad = -len(flat_ids) % pad_to_multiple_of
    if pad:
        flat_ids = torch.cat([flat_ids, flat_ids.new_zeros(pad)])
        flat_labels = torch.cat([flat_labels, flat_labels.new_full((pad,), IGNORE_INDEX)])
        pos = torch.cat([pos, torch.arange(pad, device=ids.device)])
    return {"input_ids": flat_ids[None], "labels": flat_labels[None], "position_ids": pos[None]}


def unpack(out: torch.Tensor, rows: dict, packed: bool) -> torch.Tensor:
    """The model's per-position outputs of :func:`model_rows` (``[rows, L, ...]`` or packed
    ``[1, T, ...]``) as ``[rows, S, ...]``, zero past each row's length."""
    ids, lengths = rows["input_ids"], rows["input_lengths"]
    B, S = ids.shape
    full = out.new_zeros((B, S) + tuple(out.shape[2:]))
    keep = torch.arange(S, device=ids.device)[None] < lengths[:, None]
    if packed:
        full[keep] = out[0, : int(lengths.sum())]
    else:
        L = min(out.shape[1], S)
        full[:, :L] = out[:, :L]
        full = full * keep.reshape(B, S, *([1] * (out.dim() - 2))).to(full.dtype)
    return full
