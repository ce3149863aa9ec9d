"""The shared interface of the MoE testbed and every policy both backends use.

Rooms, lowest first (each may import only the rooms below it; pyproject.toml's
import-linter contracts check it): ``core`` (errors, units, stage names), ``scenario``
(scenarios, machine profiles, topology), ``policy`` (router, pager, heat map, planner,
controller), ``run`` (backends by name, the runner, the run store), ``study`` (sweeps,
regress, the claims ledger), ``report`` (HTML pages), ``cli`` (command lines). See
docs/architecture.md.

The public entry points are importable from here: ``Scenario``, ``load_scenario``,
``load_profile``, ``run_scenario``, ``get_backend``, ``Sweep``, ``run_sweep``. They are
loaded when first used, so that ``import testbed`` stays light.
"""

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it
_PUBLIC = {
    "Scenario": "testbed.scenario.scenario",
    "load_scenario": "testbed.scenario.file",
    "load_profile": "testbed.scenario.profile",
    "run_scenario": "testbed.run.runner",
    "get_backend": "testbed.run.backend",
    "Sweep": "testbed.study.sweep",
    "run_sweep": "testbed.study.sweep",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'testbed' has no attribute {name!r}")
