"""Internal names -> the recipe keys a user writes, for error messages (the one place).

    raise ValueError(f"{recipe_key('global_batch_size')}={n} ...")  # training.global_batch_size

Components take plain arguments (``StepScheduler(global_batch_size, ...)``, ``pack_dataset(ds,
pack_size)``); their messages name the recipe key the value came from, so the user knows what to
change. A name listed in :data:`INTERNAL_NAMES` maps there; any other name that is a key of
exactly one section of ``recipe.py`` maps to ``section.key``; anything else is returned as is.
"""

from __future__ import annotations

from hybridtrain.config.recipe import SECTIONS

__all__ = ["INTERNAL_NAMES", "recipe_key"]

# Names whose recipe key is not found by recipe.py alone (in several sections, or not a key).
INTERNAL_NAMES = {
    "micro_batch_size": "training.micro_batch_size",
    "seq_length": "dataset.seq_length",
    "pad_to_multiple_of": "packing.pad_to_multiple_of",
    "dp_size": "the data-parallel size (distributed.dp_shard x distributed.dp_replicate)",
}


def recipe_key(name: str) -> str:
    """The recipe key (``section.key``) that the internal name ``name`` stands for."""
    if name in INTERNAL_NAMES:
        return INTERNAL_NAMES[name]
    found = [s.name for s in SECTIONS.values() if s.kind == "fixed" and name in s.keys]
    return f"{found[0]}.{name}" if len(found) == 1 else name
