"""The checks every configuration and recipe makes of its values, each raising a ValueError that names the value and
what it must be."""

from __future__ import annotations

import math


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def require_int(name: str, value, minimum: int = 1, what: str = "") -> None:
    """An int >= minimum; a bool is refused although Python counts it as an int (True would be taken as 1)."""
    label = f"{name} {what}".rstrip()
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
           f"{label} must be an integer >= {minimum}, got {value!r}")


def require_real(name: str, value, low: float | None = None, high: float | None = None, low_open: bool = False,
          high_open: bool = False, hint: str = "") -> None:
    """A finite real number in [low, high] (an open end with low_open / high_open); NaN and inf are refused."""
    interval = (f"{'(' if low_open else '['}{'-inf' if low is None else f'{low:g}'}, "
                f"{'inf' if high is None else f'{high:g}'}{')' if high_open or high is None else ']'}")
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    require(ok, f"{name} must be a finite number in {interval}{hint}, got {value!r}")
