"""The one internal layer-range type.

Inside meshnet a range of decoder layers is a half-open ``LayerRange`` ``[start, end)``.
The public node/tracker HTTP protocol keeps the inclusive ``shard_start``/``shard_end``
pair (``shard_end = num_layers - 1`` for the last layer); conversion happens only at the
HTTP edge through :meth:`LayerRange.from_inclusive` and :meth:`LayerRange.to_inclusive`.
See docs/adr/0002-layer-range-convention.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class LayerRange:
    """Half-open range of decoder layer indices ``[start, end)``.

    Raises:
        ValueError: if ``start < 0`` or ``end <= start``.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"invalid layer range [{self.start}, {self.end})")

    @classmethod
    def from_inclusive(cls, shard_start: int, shard_end: int) -> "LayerRange":
        """Build from the public inclusive pair (``shard_end`` is the last layer served)."""
        return cls(shard_start, shard_end + 1)

    def to_inclusive(self) -> tuple[int, int]:
        """Return the public inclusive pair ``(shard_start, shard_end)``."""
        return self.start, self.end - 1

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def contains_range(self, other: "LayerRange") -> bool:
        return self.start <= other.start and other.end <= self.end

    def overlaps(self, other: "LayerRange") -> bool:
        return self.start < other.end and other.start < self.end

    def __str__(self) -> str:
        return f"{self.start}-{self.end - 1}"

    @classmethod
    def parse(cls, text: str) -> "LayerRange":
        """Parse the inclusive operator form ``"a-b"`` (e.g. ``"0-9"`` is layers 0..9).

        Raises:
            ValueError: on malformed text.
        """
        try:
            a, b = (int(x) for x in text.split("-", 1))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"layer range must look like 'START-END' (inclusive), got {text!r}") from exc
        if b < a:
            raise ValueError(f"layer range {text!r}: END must be >= START")
        return cls.from_inclusive(a, b)


def check_inclusive_end(start: int, end: int, start_name: str, end_name: str) -> int:
    """``end`` of an inclusive range that starts at ``start`` (the public protocol's form, ADR-0002).

    Raises:
        ValueError: ``end < start``, naming both fields.
    """
    if end < start:
        raise ValueError(f"{end_name} must be >= {start_name} (inclusive range)")
    return end
