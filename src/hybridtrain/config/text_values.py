"""Recipe values written as text: durations (``training.max_time``) and signal names
(``checkpoint.save_on_signal``). Imports nothing heavy: the CLI reads them before torch."""

from __future__ import annotations

import re

__all__ = ["parse_duration", "parse_signals"]

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> float:
    """Seconds of a duration written with units, largest first: ``"3h50m"``, ``"45m"``,
    ``"90s"``, ``"1d2h"``, ``"1.5h"``; ValueError for anything else (a bare number is refused:
    its unit would be a guess)."""
    s = str(text).strip().lower().replace(" ", "")
    parts = _DURATION_RE.findall(s)
    units = [u for _, u in parts]
    if (not parts or "".join(n + u for n, u in parts) != s or len(set(units)) != len(units)
            or units != sorted(units, key=lambda u: -_SECONDS[u])):
        raise ValueError(f"{text!r} is not a duration: write it with units, largest first, "
                         f"e.g. '3h50m', '45m', '90s' or '1d2h'")
    seconds = sum(float(n) * _SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"{text!r}: a time limit must be longer than 0s")
    return seconds


def parse_signals(names: list) -> list[int]:
    """Signal numbers of ``['SIGTERM', 'USR1', ...]`` (with or without the SIG prefix, any
    case); ValueError naming a name this system does not have or one that cannot be caught."""
    import signal

    out = []
    for name in names:
        key = str(name).strip().upper()
        key = key if key.startswith("SIG") else "SIG" + key
        sig = getattr(signal, key, None)
        if not isinstance(sig, signal.Signals) or key.startswith("SIG_") or \
                sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{name!r} is not a signal a run can catch (e.g. SIGTERM, SIGUSR1, "
                             f"SIGUSR2, SIGINT)")
        out.append(int(sig))
    return out
