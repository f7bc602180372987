"""A measure: an exact value, or the hard bounds known about it, or absent (None)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Measure:
    """An exact value, or the hard bounds known about it (either may be None)."""

    exact: float | None = None
    lower: float | None = None
    upper: float | None = None

    @staticmethod
    def of(value: float | None) -> Measure | None:
        return None if value is None else Measure(exact=value)

    @staticmethod
    def bounds(lower: float | None, upper: float | None) -> Measure | None:
        if lower is None and upper is None:
            return None
        if lower is not None and upper is not None and lower == upper:
            return Measure(exact=lower)
        return Measure(lower=lower, upper=upper)

    def series(self) -> Iterator[tuple[str, float]]:
        """(basis, value) pairs, as exported."""
        if self.exact is not None:
            yield "exact", self.exact
            return
        if self.lower is not None:
            yield "lower_bound", self.lower
        if self.upper is not None:
            yield "upper_bound", self.upper

    def scale(self, factor: float) -> Measure:
        return Measure(*(None if v is None else v * factor for v in (self.exact, self.lower, self.upper)))

    def shift(self, offset: float) -> Measure:
        return Measure(*(None if v is None else v + offset for v in (self.exact, self.lower, self.upper)))

    def negate(self) -> Measure:
        """-x: bounds swap sides."""
        if self.exact is not None:
            return Measure(exact=-self.exact)
        return Measure(
            lower=None if self.upper is None else -self.upper,
            upper=None if self.lower is None else -self.lower,
        )

    @property
    def lo(self) -> float | None:
        return self.exact if self.exact is not None else self.lower

    @property
    def hi(self) -> float | None:
        return self.exact if self.exact is not None else self.upper


def scaled(m: Measure | None, factor: int | None) -> Measure | None:
    if m is None or factor is None:
        return None
    return m.scale(factor)
