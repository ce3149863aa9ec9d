"""How a machine profile's keys are declared and read (``testbed.scenario.profile`` holds its
sections): ``_num``, ``_optional_num``, ``_optional_int``, ``_text``, ``_optional_text``,
``_flag``, ``_curve``, ``_section`` and ``_rows`` declare a key (its one-line doc, kind, check
and default, in the dataclass field's metadata); ``_build`` reads a parsed TOML table into its
section, coercing and checking every value (numbers finite, whole where an int, curves of
(x, y) points with x > 0 strictly increasing, records with exactly their fields) and naming
``profile LABEL: dotted.key`` and the value in every ``ScenarioError``; ``_plain`` turns a
profile back into a TOML-ready mapping. A key's unit is in its name (``_us``: microseconds,
``_GBps``: 1e9 bytes/s, ``_MiB``: 2**20 bytes). A scenario's own fields are declared and read
by ``testbed.scenario.fields``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import field
from typing import Any, Callable

from testbed.core.checks import non_negative, positive
from testbed.core.errors import ScenarioError


# ---- field declarations --------------------------------------------------------------
def _num(doc: str, check: Callable[[float], str | None] = positive):
    return field(metadata={"doc": doc, "kind": "float", "check": check})


def _optional_num(doc: str, default: float, check: Callable[[float], str | None] = non_negative):
    return field(default=default, metadata={"doc": doc, "kind": "float", "check": check, "optional": True})


def _optional_int(doc: str, default: int, check: Callable[[float], str | None] = non_negative):
    return field(default=default, metadata={"doc": doc, "kind": "int", "check": check, "optional": True})


def _optional_text(doc: str, default: str = "", choices: tuple[str, ...] = ()):
    return field(default=default, metadata={"doc": doc, "kind": "str", "choices": choices, "optional": True})


def _flag(doc: str, default: bool = False):
    return field(default=default, metadata={"doc": doc, "kind": "bool", "optional": True})


def _text(doc: str, choices: tuple[str, ...] = ()):
    return field(metadata={"doc": doc, "kind": "str", "choices": choices})


def _curve(doc: str, check: Callable[[float], str | None]):
    """A table of (x, y) points, x > 0 strictly increasing; stored as a tuple of pairs."""
    return field(metadata={"doc": doc, "kind": "curve", "check": check})


def _section(cls: type, doc: str):
    return field(metadata={"doc": doc, "kind": "section", "cls": cls})


def _rows(doc: str, **fields):
    return field(default=(), metadata={"doc": doc, "kind": "records", "fields": fields, "optional": True})


# ---- reading TOML into sections, and back --------------------------------------------
def _error(label: str, key: str, value: Any, reason: str) -> ScenarioError:
    return ScenarioError(f"profile {label}: {key}", value, reason)


def _build(cls: type, data: Any, prefix: str, label: str):
    if not isinstance(data, dict):
        raise _error(label, prefix.rstrip(".") or "profile", data, "expected a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(fields)})"
            raise _error(label, prefix + key, value, "unknown key" + hint)
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.metadata.get("optional"):
                continue  # the dataclass default stands
            raise _error(label, prefix + name, None, "missing: " + f.metadata["doc"])
        kwargs[name] = _coerce(f.metadata, data[name], prefix + name, label)
    return cls(**kwargs)


def _number(value: Any, key: str, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _error(label, key, value, "expected a finite number")
    return float(value)


def _coerce(meta: dict, value: Any, key: str, label: str) -> Any:
    kind = meta["kind"]
    if kind == "section":
        return _build(meta["cls"], value, key + ".", label)
    if kind == "str":
        if not isinstance(value, str):
            raise _error(label, key, value, "expected a string")
        if meta["choices"] and value not in meta["choices"]:
            raise _error(label, key, value, "expected one of " + ", ".join(meta["choices"]))
        return value
    if kind == "strmap":
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise _error(label, key, value, "expected a table of strings")
        return dict(value)
    if kind == "records":
        return _records(meta, value, key, label)
    if kind == "bool":
        if not isinstance(value, bool):
            raise _error(label, key, value, "expected true or false")
        return value
    if kind == "int":
        v = _number(value, key, label)
        if v != int(v):
            raise _error(label, key, value, "expected a whole number")
        reason = meta["check"](v)
        if reason:
            raise _error(label, key, value, reason)
        return int(v)
    if kind == "float":
        v = _number(value, key, label)
        reason = meta["check"](v)
        if reason:
            raise _error(label, key, value, reason)
        return v
    # curve: [[x, y], ...]
    if not isinstance(value, list) or not value or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise _error(label, key, value, "expected a non-empty list of [x, y] pairs")
    points = tuple((_number(x, key, label), _number(y, key, label)) for x, y in value)
    xs = [x for x, _ in points]
    if xs[0] <= 0 or any(b <= a for a, b in zip(xs, xs[1:])):
        raise _error(label, key, value, "x values must be > 0 and strictly increasing")
    for _, y in points:
        reason = meta["check"](y)
        if reason:
            raise _error(label, key, value, f"y value {y}: {reason}")
    return points


def _records(meta: dict, value: Any, key: str, label: str) -> tuple:
    """A list of inline tables with exactly the fields ``meta["fields"]`` (name -> type)."""
    spec = meta["fields"]
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise _error(label, key, value, "expected a list of tables {" + ", ".join(spec) + "}")
    out = []
    for i, row in enumerate(value):
        if set(row) != set(spec):
            raise _error(label, f"{key}[{i}]", row, "expected the keys " + ", ".join(spec))
        clean = {}
        for name, typ in spec.items():
            v = row[name]
            if typ is str:
                if not isinstance(v, str):
                    raise _error(label, f"{key}[{i}].{name}", v, "expected a string")
            else:
                v = _number(v, f"{key}[{i}].{name}", label)
                if v < 0:
                    raise _error(label, f"{key}[{i}].{name}", v, "must be >= 0")
                v = int(v) if typ is int else v
            clean[name] = v
        out.append(clean)
    return tuple(out)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return dict(obj)
    return obj
