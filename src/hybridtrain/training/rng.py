"""Seeding and JSON-serialisable RNG states (python, numpy, torch CPU, torch CUDA).

States are plain JSON (no pickle), one file per rank in a checkpoint. A recipe's own generator
(a ``random.Random`` or a ``torch.Generator``) goes to JSON with :func:`generator_state` and back
with :func:`set_generator_state`.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None


def seed_all(seed: int) -> None:
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _bytes(t: torch.Tensor) -> list[int]:
    return t.tolist()


def get_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": _bytes(torch.get_rng_state()),
    }
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _bytes(torch.cuda.get_rng_state())  # current device only
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def generator_state(gen: random.Random | torch.Generator) -> list:
    """The JSON-serialisable state of one generator (CPU ``torch.Generator`` or ``random.Random``)."""
    if isinstance(gen, random.Random):
        version, internal, gauss = gen.getstate()
        return [version, list(internal), gauss]
    return _bytes(gen.get_state())


def set_generator_state(gen: random.Random | torch.Generator, state: list) -> None:
    """Restores what :func:`generator_state` returned."""
    if isinstance(gen, random.Random):
        version, internal, gauss = state
        gen.setstate((version, tuple(internal), gauss))
    else:
        gen.set_state(torch.tensor(state, dtype=torch.uint8))
