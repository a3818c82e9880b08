"""The units headfold reads from users, parsed in one place: sizes (2GB, 500MiB), fractions (0.05,
5%) and counts (200000, 200k, 1.5M); and the domains of numeric options. Precision names: ground.precision."""

from __future__ import annotations

import math
import re
from typing import Any

from headfold.ground.errors import BadOption
from headfold.ground.inputs import shown

# Numbers in ASCII digits only: int() and float() also take '5_0', '+9' and other scripts' digits ('٥٠').
_WHOLE = re.compile(r"-?[0-9]+")
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|-?inf|nan", re.IGNORECASE)
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?i?B)?\s*", re.IGNORECASE)
COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def whole_number(text: str) -> int | None:
    """`text` (blanks around it allowed) as an integer written in ASCII digits, a minus sign allowed; else None."""
    return int(text) if _WHOLE.fullmatch(text := text.strip()) else None


def _decimal(text: str) -> float:
    """`text` as a number in ASCII digits (a decimal point and exponent allowed); ValueError for anything else."""
    if not _DECIMAL.fullmatch(text.strip()):
        raise ValueError(text)
    return float(text)


def parse_size(size: str | int, name: str = "size") -> int:
    """'500MB', '2GiB', '5GB' or a byte count → bytes (positive)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.fullmatch(str(size))
        if not m:
            raise BadOption(name, f"{size!r} is not a size; write e.g. 500MB or 2GiB")
        unit = (m.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        value = int(float(m.group(1)) * base ** "BKMGT".index(unit[0]))
    if value <= 0:
        raise BadOption(name, f"{size!r} must be positive")
    return value


def parse_fraction(value: Any, name: str) -> float:
    """0.05, "0.05" or "5%" → 0.05; BadInput for anything else, a negative or a non-finite value."""
    text = str(value).strip()
    try:
        number = _decimal(text[:-1]) / 100 if text.endswith("%") else _decimal(text)
    except ValueError:
        raise BadOption(name, f"= {shown(value)} is not a number; write e.g. 0.05 or 5%") from None
    if not (math.isfinite(number) and number >= 0):
        raise BadOption(name, f"= {shown(value)} must be a finite number of at least 0")
    return number


def parse_count(value: Any, name: str, unit: str, examples: str = "e.g. 200000, 200k or 1.5M") -> int:
    """200000, '200k', '1.5M', '2B' (of `unit`s) → a whole count of at least 1, rounded down."""
    text = str(value).strip()
    count: float | None
    try:
        if text[-1:].lower() in COUNT_SUFFIXES:
            count = _decimal(text[:-1]) * COUNT_SUFFIXES[text[-1].lower()]
        elif isinstance(value, float):
            count = value
        elif (count := whole_number(text)) is None:
            raise ValueError(text)
    except ValueError:
        raise BadOption(name, f"{value!r} is not a {unit} count; give one, {examples}") from None
    if not (math.isfinite(count) and count >= 1):
        raise BadOption(name, f"must be at least 1 {unit}, got {value!r}; {examples}")
    return int(count)


def whole(option: str, value: Any, least: int, why: str = "") -> None:
    """BadOption unless `value` (None: unset) is an integer of at least `least` (`why`: what needs it)."""
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        raise BadOption(option, f"must be a whole number of at least {least}{why}, got {shown(value)}")


def finite(option: str, value: Any, *, above: float | None = None, least: float | None = None, most: float | None = None) -> None:
    """BadOption unless `value` (None: unset) is a finite number above `above`, from `least`, up to `most`."""
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (number and (above is None or value > above) and (least is None or value >= least) and (most is None or value <= most)):
        bounds = " and ".join(f"{word} {bound:g}" for bound, word in ((above, "above"), (least, "of at least"), (most, "up to")) if bound is not None)
        raise BadOption(option, f"must be a finite number {bounds}".rstrip() + f", got {shown(value)}")
