"""``dist_env``: environment variables from the recipe, set before CUDA / process-group init.

.. code-block:: yaml

    dist_env:
      torch_nccl_use_comm_nonblocking: true     # -> TORCH_NCCL_USE_COMM_NONBLOCKING=1
      pytorch_alloc_conf: expandable_segments:True   # -> PYTORCH_ALLOC_CONF=...
      nccl_debug: WARN

Keys are upper-cased; ``true``/``false`` become ``1``/``0``; numbers their text. A variable that
is already set in the environment wins (the launcher or user knows better) and is reported once
per process. ``null`` is an error -- it is never exported as the string "None".

Then the process defaults (:data:`PROCESS_DEFAULTS`, :func:`apply_process_defaults`) fill the
variables neither the environment nor the recipe set: ``OMP_WAIT_POLICY=PASSIVE``, so torch's
OpenMP threads sleep between parallel regions instead of spinning. Spinning threads compete with
the one that has work whenever other jobs share the cores (2 cores at load ~4, 2026-11-26, the
same invocation: squad_tiny's model 1.2-4.3 s per step spinning, 0.20 s passive, 0.17-0.20 s
with one thread; vlm_tiny's 2.8 s vs 0.39 s vs 0.36 s). Restore spinning with
``OMP_WAIT_POLICY=ACTIVE`` (environment or ``dist_env``).

The CLI applies both right after loading the recipe, before importing torch. Call
``apply_dist_env(cfg.dist_env)`` yourself when driving hybridtrain from Python, before
``torch.cuda`` or ``torch.distributed`` are used.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any, Callable, Mapping, MutableMapping

from hybridtrain.config.errors import ConfigError

__all__ = ["dist_env_vars", "apply_dist_env", "apply_process_defaults", "PROCESS_DEFAULTS"]

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REPORTED: set[str] = set()  # variables already reported as "set in the environment"

PROCESS_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}  # read by libgomp when torch first loads


def _default_where(section: Mapping) -> Callable[[str], str]:
    where = getattr(section, "where", None)
    if callable(where):
        return lambda key: where(key)
    return lambda key: "dist_env"


def dist_env_vars(section: Mapping[str, Any] | None,
                  where: Callable[[str], str] | None = None) -> dict[str, str]:
    """The variables a ``dist_env`` section asks for: ``{"NAME": "value"}`` (validated)."""
    if not section:
        return {}
    where = where or _default_where(section)
    out: dict[str, str] = {}
    origin: dict[str, str] = {}
    for key, value in section.items():
        if not isinstance(key, str) or not _NAME_RE.match(key):
            raise ConfigError(f"dist_env key {key!r} ({where(str(key))}) is not a valid "
                              f"environment variable name (letters, digits, _)")
        if value is None:
            raise ConfigError(
                f"dist_env.{key} is null ({where(key)}); give it a value (true/false, a "
                f"number or a string) or remove the key -- null is never exported")
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, (int, float, str)):
            text = str(value)
        else:
            raise ConfigError(f"dist_env.{key} must be a string, number or boolean, got "
                              f"{type(value).__name__} {value!r} ({where(key)})")
        name = key.upper()
        if name in out:
            raise ConfigError(f"dist_env.{key} and dist_env.{origin[name]} both set {name} "
                              f"({where(key)}); keep one")
        out[name] = text
        origin[name] = key
    return out


def apply_dist_env(section: Mapping[str, Any] | None,
                   environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Export the section's variables into ``environ`` (default ``os.environ``).

    Returns the variables actually set. A variable already present keeps its value; if that
    differs from the recipe's, a warning says so (once per variable per process).
    """
    environ = os.environ if environ is None else environ
    wanted = dist_env_vars(section)
    applied: dict[str, str] = {}
    for name, value in wanted.items():
        current = environ.get(name)
        if current is None:
            environ[name] = value
            applied[name] = value
            continue
        if name in _REPORTED:
            continue
        _REPORTED.add(name)
        if current != value:
            logger.warning("dist_env: %s is already set in the environment to %r; keeping it "
                           "(the recipe asks for %r)", name, current, value)
        else:
            logger.debug("dist_env: %s already set to %r", name, current)
    if applied:
        logger.info("dist_env: set %s", ", ".join(f"{k}={v}" for k, v in applied.items()))
        _warn_if_too_late()
    return applied


def _warn_if_too_late() -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        late = torch.cuda.is_initialized() or (torch.distributed.is_available()
                                               and torch.distributed.is_initialized())
    except Exception:  # noqa: BLE001 - a best-effort diagnostic only
        return
    if late:
        logger.warning("dist_env was applied after CUDA or the process group was initialised; "
                       "some variables may have no effect")


def apply_process_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of :data:`PROCESS_DEFAULTS` that ``environ`` (default ``os.environ``) lacks;
    returns those set. Call after :func:`apply_dist_env` (a recipe's value wins) and before
    ``import torch`` (libgomp reads the variable once, when it loads)."""
    environ = os.environ if environ is None else environ
    applied = {k: v for k, v in PROCESS_DEFAULTS.items() if k not in environ}
    environ.update(applied)
    return applied
