"""Small checks the parameter classes share."""

from __future__ import annotations

import difflib
import enum
import math

import torch

# The names an nn.ModuleDict already has (its methods, and fields such as ``training``), read
# from an instance, so that the list is torch's own.
_MODULE_DICT_NAMES = frozenset(dir(torch.nn.ModuleDict()))
# A table name's fix where TorchRec cannot keep it.
RENAME_TABLE = "rename the table (TorchRec keeps a collection's tables in an nn.ModuleDict, keyed by name)"


def module_key_problem(name: str) -> str | None:
    """Why an ``nn.ModuleDict`` refuses ``name`` as a key, or None. TorchRec's collections keep
    their tables in one, and refuse such a name only when the module is built (a KeyError that
    names no fix)."""
    if "." in name:
        return f"'{name}' contains '.', which a module's name may not"
    if name in _MODULE_DICT_NAMES:
        return f"'{name}' is already an attribute of nn.ModuleDict"
    return None


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def finite(value) -> bool:
    """A real, finite number (not a bool, which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
