"""Durations as users write them in GpuJob specs: "90s", "45m", "2h", "1h30m", "1d".

The CRD's OpenAPI pattern accepts exactly what `parse_duration` accepts (DURATION_PATTERN),
so a spec the API server admits never fails here.
"""

from __future__ import annotations

import re

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h|d))+$"
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration string; ValueError naming the text when it is not one."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"not a duration (want e.g. '90s', '45m', '1h30m', '2d'): {text!r}")
    return sum(float(n) * _SECONDS[unit] for n, unit in _PART.findall(text))


def format_duration(seconds: float) -> str:
    """Short human form, the inverse of parse_duration for whole seconds: 5400 -> '1h30m'."""
    total = max(0, round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    text = "".join(f"{n}{u}" for n, u in parts if n)
    return text or "0s"


def format_duration_roughly(seconds: float) -> str:
    """A short duration for tables and messages, coarser as it grows (`format_duration`
    gives it exactly): 95s, 7m30s, 42m, 3h20m, 20h, 2d6h, 12d."""
    s = round(abs(seconds))
    if s < 120:
        return f"{s}s"
    if s < 600:
        minutes, rest = divmod(s, 60)
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    minutes = round(s / 60)
    if minutes < 180:
        return f"{minutes}m"
    if minutes < 8 * 60:
        hours, rest = divmod(minutes, 60)
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    hours = round(s / 3600)
    if hours < 48:
        return f"{hours}h"
    if hours < 8 * 24:
        days, rest = divmod(hours, 24)
        return f"{days}d{rest}h" if rest else f"{days}d"
    return f"{round(s / 86400)}d"
