"""Reading a scenario from a TOML file plus ``--set section.key=value`` overrides."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

from testbed.core.errors import ScenarioError
from testbed.scenario.scenario import Scenario


def read_toml(path: str | Path) -> dict:
    """The scenario file's tables. A directory, a missing, unreadable, empty or invalid file
    is a ScenarioError of its own (an empty file would silently run every default)."""
    p = Path(path)
    if p.is_dir():
        raise ScenarioError("config", str(path), "is a directory, not a scenario file (e.g. configs/quickstart.toml)")
    if not p.exists():
        raise ScenarioError("config", str(path), "no such file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError("config", str(path), f"cannot read it: {e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError("config", str(path), f"not valid TOML: {e}") from None
    if not data:
        raise ScenarioError("config", str(path), "is empty: give at least one [section] (or no file at all for "
                            "the built-in defaults)")
    return data


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
