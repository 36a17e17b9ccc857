"""The base of the typed recipe sections (``section_types.py``, generated from schema.py)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, ClassVar

from hybridtrain.config.node import ConfigNode

__all__ = ["RecipeSection", "with_node"]


@dataclasses.dataclass(frozen=True)
class RecipeSection:
    """Base of the typed sections. ``where(key)`` names where a value was set ("recipe.yaml:12",
    a command-line override, or the recipe file for a schema default)."""

    section: ClassVar[str] = ""

    def where(self, key: str | None = None) -> str:
        node = self.__dict__.get("_node")
        if node is not None:
            return node.where(key)
        return f"'{self.section}' section built in code"

    def to_dict(self) -> dict[str, Any]:
        """The values, copied (e.g. ``LRScheduler(**section.to_dict())``)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> RecipeSection:
        """A copy with ``changes`` (``where`` still names the recipe's lines)."""
        return with_node(dataclasses.replace(self, **changes), self.__dict__.get("_node"))


def with_node(section: RecipeSection, node: ConfigNode | None) -> RecipeSection:
    """``section`` remembering the loaded ``node`` it came from (for ``where``)."""
    object.__setattr__(section, "_node", node)  # not a field: equality and repr ignore it
    return section
