"""How a scenario's fields are declared and read: ``doc`` declares one (its default,
one-line doc, type, choices and check), ``build_section`` reads a TOML table into its
section, coercing and checking every value and naming the dotted field and the value in
every ``ScenarioError``. The sections themselves are in ``testbed.scenario.sections``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import field
from typing import Any, Callable

from testbed.core.errors import ScenarioError
from testbed.core.units import parse_bytes

#: the largest integer a field may hold: every size stays exact in a float, and products of
#: a few of them stay finite (what would not fit this machine is refused by testbed.run.guards)
MAX_INT = 2**53


def doc(text: str, default: Any, *, check: Callable[[Any], str | None] | None = None,
        kind: type | tuple = (), choices: tuple = (), size: bool = False):
    """A scenario field: its default, one-line doc, type, allowed choices and a check.

    ``check(value)`` returns None when the value is fine, else the reason it is not.
    ``size=True`` accepts byte sizes written as strings ("16MiB").
    """
    meta = {"doc": text, "check": check, "kind": kind or type(default),
            "choices": choices, "size": size}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def unknown(name: str, known: list[str], what: str) -> str:
    """Why ``name`` is refused, with the closest known one."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(known)})"
    return f"unknown {what}{hint}"


def build_section(section: str, cls: type, values: dict):
    """``cls`` (a section) from a TOML table, every key known and every value checked."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        path = f"{section}.{key}"
        if key not in known:
            raise ScenarioError(path, value, unknown(key, list(known), "key"))
        kwargs[key] = coerce(path, known[key].metadata, value)
    return cls(**kwargs)


def coerce(path: str, meta: dict, value: Any) -> Any:
    """``value`` as the field's type (sizes from "16MiB"), within its choices and check."""
    kind = meta["kind"]
    if meta["size"]:
        try:
            value = parse_bytes(value)
        except ValueError as e:
            raise ScenarioError(path, value, str(e)) from None
        if value > MAX_INT:
            raise ScenarioError(path, value, f"too large: at most {MAX_INT:,} bytes (2**53)")
    elif kind is bool:
        if not isinstance(value, bool):
            raise ScenarioError(path, value, "expected true or false")
    elif kind is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ScenarioError(path, value, "expected an integer")
        value = int(value)
        if abs(value) > MAX_INT:
            raise ScenarioError(path, value, f"too large: at most {MAX_INT:,} (2**53)")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScenarioError(path, value, "expected a number")
        value = float(value)
        if not math.isfinite(value):
            raise ScenarioError(path, value, "expected a finite number")
    elif kind is str:
        if not isinstance(value, str):
            raise ScenarioError(path, value, "expected a string")
    if meta["choices"] and value not in meta["choices"]:
        raise ScenarioError(path, value, "expected one of " + ", ".join(meta["choices"]))
    if meta["check"] is not None:
        reason = meta["check"](value)
        if reason:
            raise ScenarioError(path, value, reason)
    return value
