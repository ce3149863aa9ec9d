"""Model presets (``model.preset = NAME``: configs/models/NAME.toml) and imported
Hugging Face configs (``model.config = PATH``, ``testbed.scenario.hf_config``): the
[model], [transformer] and [router] fields of one model, which fill a scenario's where
it leaves them out. What the scenario states wins.

The filling happens on the scenario's tables as read (``Scenario.from_dict``), so a
field counts as stated when its key is in the file or a ``--set``; a resolved scenario
(``Scenario.to_dict``) states every field, so it takes nothing from its preset again.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

from testbed.core.errors import ScenarioError
from testbed.scenario.hf_config import read_config

#: the repository's configs/models: one TOML per preset
PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
#: the tables a preset (or config.json) fills
MODEL_TABLES = ("model", "transformer", "router")


def preset_names(directory: Path = PRESETS_DIR) -> list[str]:
    """The shipped presets, by name."""
    return sorted(p.stem for p in directory.glob("*.toml")) if directory.is_dir() else []


def preset_path(name: str, directory: Path = PRESETS_DIR) -> Path:
    path = directory / f"{name}.toml"
    if not name or "/" in name or not path.is_file():
        raise ScenarioError("model.preset", name, "no such preset (" + (", ".join(preset_names(directory))
                            or f"none in {directory}") + "; testbed model --list)")
    return path


def load_preset(name: str, directory: Path = PRESETS_DIR) -> dict:
    """The tables of preset ``name``: [model], [transformer] and [router] only, and none
    of them naming a preset or config itself."""
    path = preset_path(name, directory)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ScenarioError("model.preset", name, f"cannot read {path}: {e}") from None
    for table, fields in data.items():
        if table not in MODEL_TABLES or not isinstance(fields, dict):
            raise ScenarioError("model.preset", name, f"{path} holds [{table}]: a preset gives only the tables "
                                + ", ".join(MODEL_TABLES))
    for key in ("preset", "config"):
        if key in data.get("model", {}):
            raise ScenarioError("model.preset", name, f"{path} sets model.{key}: a preset is its fields, not another's")
    return data


def model_source(model: dict) -> tuple[str, dict] | None:
    """(the field that names it, its tables) of the preset or config.json a scenario's
    [model] table names; None when it names neither."""
    preset, config = model.get("preset", ""), model.get("config", "")
    for key, value in (("model.preset", preset), ("model.config", config)):
        if not isinstance(value, str):
            raise ScenarioError(key, value, "expected a string")
    if preset and config:
        raise ScenarioError("model.config", config, f"give model.preset or model.config, not both (model.preset = "
                            f"{preset!r})")
    if preset:
        return "model.preset", load_preset(preset)
    if config:
        return "model.config", read_config(config)
    return None


def fill_model_tables(data: dict) -> dict:
    """``data`` (a scenario's tables) with the [model], [transformer] and [router] fields of
    the preset or config.json its [model] names filled in where it leaves them out; the
    input is not changed."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        return data
    source = model_source(model)
    if source is None:
        return data
    out = copy.deepcopy(data)
    for table, fields in source[1].items():
        stated = out.get(table, {})
        if not isinstance(stated, dict):
            continue  # Scenario.from_dict names a table that is not one
        out[table] = {**fields, **stated}
    return out
