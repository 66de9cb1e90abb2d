"""Share IDs `<gpu-uuid>::<n>`: the device IDs the device plugin advertises to the kubelet.

Built and parsed here only, so the extender, the plugin and the tests agree.
"""

from __future__ import annotations

from dataclasses import dataclass

SEPARATOR = "::"


@dataclass(frozen=True, order=True)
class ShareId:
    gpu_uuid: str
    index: int

    def __str__(self) -> str:
        return f"{self.gpu_uuid}{SEPARATOR}{self.index}"

    @classmethod
    def parse(cls, text: str) -> ShareId:
        uuid, sep, index = text.rpartition(SEPARATOR)
        if not sep or not uuid or not index.isdigit():
            raise ValueError(f"not a Carpool share ID (want '<gpu-uuid>::<n>'): {text!r}")
        return cls(uuid, int(index))


def shares_of(gpu_uuid: str, count: int) -> list[ShareId]:
    """The `count` share IDs advertised for one GPU."""
    return [ShareId(gpu_uuid, n) for n in range(count)]
