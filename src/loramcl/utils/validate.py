"""The checks every configuration and recipe makes of its values, each raising a ValueError that names the value and
what it must be."""

from __future__ import annotations

import functools
import math

# The largest seed of every seed option: numpy's generators take seeds below 2^32 (torch's, below 2^64), so a seed
# that works for one command works for all.
MAX_SEED = 2**32 - 1


class OptionError(ValueError):
    """A value that is not allowed. Its message starts with ``option``, the name of the field or argument that holds
    it; ``owner`` is the configuration class of that field, so that the command line can name the option as the user
    typed it (`--training.learning_rate`, `--top_p`: ``loramcl.cli``)."""

    def __init__(self, option: str, message: str, owner: type | None = None) -> None:
        super().__init__(message)
        self.option, self.owner = option, owner


def names_its_options(cls: type) -> type:
    """Class decorator: an ``OptionError`` raised by ``cls.__post_init__`` has ``cls`` as its owner (the outermost
    one when a configuration checks its fields by making another, as ``MoEConfig`` makes an ``MCLConfig``)."""
    check = cls.__post_init__

    @functools.wraps(check)
    def __post_init__(self) -> None:
        try:
            check(self)
        except OptionError as error:
            error.owner = cls
            raise

    cls.__post_init__ = __post_init__
    return cls


def require(condition: bool, message: str, option: str | None = None) -> None:
    """A ValueError with ``message`` unless ``condition`` (an ``OptionError`` when ``message`` is about ``option``)."""
    if not condition:
        raise OptionError(option, message) if option else ValueError(message)


def require_int(name: str, value, minimum: int = 1, what: str = "", maximum: int | None = None,
                hint: str = "") -> None:
    """An int >= minimum (and <= maximum, with ``hint`` saying why); a bool is refused although Python counts it as
    an int (True would be taken as 1)."""
    label = f"{name} {what}".rstrip()
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
            f"{label} must be an integer >= {minimum}, got {value!r}", name)
    if maximum is not None:
        require(value <= maximum, f"{label} must be at most {maximum}{hint}, got {value!r}", name)


def require_seed(name: str, value) -> None:
    """A seed: an integer in [0, MAX_SEED]."""
    require(isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED,
            f"{name} must be an integer in [0, 2**32 - 1] (a seed numpy and torch both take), got {value!r}", name)


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
    require(ok, f"{name} must be a finite number in {interval}{hint}, got {value!r}", name)
