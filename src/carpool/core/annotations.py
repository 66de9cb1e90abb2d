"""Reading JSON that Carpool keeps in pod annotations, safely.

Annotations are user-writable text: anything may be there. A value that is too large or too
deeply nested (which makes Python's json module raise RecursionError, not ValueError) must be
refused as malformed like any other bad value, never crash the component reading it.
"""

from __future__ import annotations

import json
from typing import Any

MAX_ANNOTATION_JSON = 64 * 1024  # our own values are a few hundred bytes
MAX_DEPTH = 32


def _depth_ok(text: str) -> bool:
    """True if brackets never nest deeper than MAX_DEPTH (strings are skipped)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def load_annotation_json(text: str, what: str) -> Any:
    """The parsed value; ValueError naming `what` when it is not small, shallow, valid JSON."""
    if len(text) > MAX_ANNOTATION_JSON:
        raise ValueError(f"{what} is {len(text)} bytes, more than {MAX_ANNOTATION_JSON}")
    if not _depth_ok(text):
        raise ValueError(f"{what} nests deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{what} is not JSON: {err}") from None
