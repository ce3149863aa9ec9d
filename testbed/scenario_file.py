"""Reading a scenario from a TOML file plus ``--set section.key=value`` overrides."""

from __future__ import annotations

import copy

from pathlib import Path

import tomllib

from testbed.errors import ScenarioError
from testbed.scenario import Scenario


def read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ScenarioError("config", str(path), "no such file")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ScenarioError("config", str(path), f"not valid TOML: {e}") from None


def apply_override(data: dict, item: str) -> None:
    """Apply ``section.key=value`` to ``data``; the value is read as TOML, else as a string."""
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ScenarioError("--set", item, "expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word such as allgather
    section = data.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ScenarioError(parts[0], section, "expected a table")
    section[parts[1]] = value


def load_scenario(path: str | Path | None = None, overrides=(), base: dict | None = None) -> Scenario:
    """The scenario of ``path`` (None: ``base``, or every default) with ``overrides``
    applied, validated."""
    data = (copy.deepcopy(base) if base else {}) if path is None else read_toml(path)
    for item in overrides:
        apply_override(data, item)
    return Scenario.from_dict(data)
