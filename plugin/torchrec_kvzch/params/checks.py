"""Small checks the parameter classes share."""

from __future__ import annotations

import difflib
import enum


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def pair(value, name, fail) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        fail(name, f"must be a pair of numbers, got {value!r}", "e.g. (low, high)")
    return a, b


def member(cls: type[enum.Enum], value, what: str, fail):
    """The member of ``cls`` that ``value`` (a member or its value, any case) names; else
    ``fail("<what> <value> is unknown; [did you mean ...?] use one of ...")``."""
    try:
        return cls(str(getattr(value, "value", value)).lower())
    except ValueError:
        names = [m.value for m in cls]
        close = difflib.get_close_matches(str(value).lower(), names, n=1)
        fail(f"{what} {value!r} is unknown; " + (f"did you mean '{close[0]}'? " if close else "")
             + f"use one of {', '.join(names)}")
