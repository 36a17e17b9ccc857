"""The config package's user errors (a leaf module: it imports nothing of hybridtrain)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A mistake in a recipe or an override. The message names the key and where it was set."""
