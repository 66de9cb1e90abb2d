"""Kubernetes resource quantities ("16Gi", "500M", "1.5", "250m") as numbers.

Only what GpuJob, ProjectQuota and Pod resources use; a malformed quantity raises ValueError
naming the text, which the operator turns into a status reason.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from functools import lru_cache

_SUFFIX = {
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40, "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
}
_QUANTITY = re.compile(
    r"^([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")

MIB = 2**20


def parse_quantity(text: str | int | float) -> Decimal:
    """The value of a quantity in base units (bytes for memory, cores for CPU)."""
    if isinstance(text, bool):
        raise ValueError(f"not a quantity: {text!r}")
    if isinstance(text, int | float):
        return Decimal(str(text))
    match = _QUANTITY.match(text.strip())
    if not match:
        raise ValueError(f"not a quantity (want e.g. '16Gi', '500M', '2'): {text!r}")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:
        raise ValueError(f"not a quantity: {text!r}") from None
    return number * _SUFFIX[match.group(2) or ""]


# A pod's CPU and memory are read on every watch event of it (the extender's cache), from
# a few distinct texts: each is parsed once. (typed: 1 and 1.0 are kept apart.)
@lru_cache(maxsize=4096, typed=True)
def quantity_mib(text: str | int | float) -> int:
    """A memory quantity in whole MiB, rounded up (a job never gets less than it asked)."""
    return math.ceil(parse_quantity(text) / MIB)


@lru_cache(maxsize=4096, typed=True)
def quantity_milli(text: str | int | float) -> int:
    """A CPU quantity in millicores, rounded up."""
    return math.ceil(parse_quantity(text) * 1000)


def gib_ceil(mib: int) -> int:
    """MiB as whole GiB, rounded up: the unit of the carpool.dev/gpu-memory resource."""
    return -(-mib // 1024)
