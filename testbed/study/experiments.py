"""The experiment scripts of ``experiments/``: the options every one runs with
(``Options``, what its command line chose) and loading a script by path. The folder is
no package and nothing in the project imports it; the claims ledger and the tests load
a script's module this way to reuse its sweep and its judgements."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario
from testbed.study.sweep import Sweep

#: the repository root: experiments/, configs/ and reports/ are found from it
ROOT = Path(__file__).resolve().parents[2]


def load_experiment(name: str):
    """The module of ``experiments/NAME.py``, loaded by path and registered under ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Options:
    """What the command line chose, as ``build`` sees it."""

    quick: bool
    backends: tuple[str, ...]
    fabric: str  # emulated or loopback (auto resolved)
    profile: str | None  # calibrated profile for both sides; None: the scenario's own (sim only)
    repeats: int
    output_dir: str | None  # the run store; None: the scenario's run.output_dir
    overrides: list[str] = field(default_factory=list)

    def base(self, path: str | Path | None = None, data: dict | None = None) -> Scenario:
        """A base scenario (a config file or a mapping) with the command line's ``--set``
        and the run store applied."""
        s = load_scenario(path, self.overrides, base=data)
        return s.replace(run={"output_dir": self.output_dir}) if self.output_dir else s

    @property
    def real_set(self) -> dict:
        out = {"real.network": "emulated"} if self.fabric == "emulated" else {}
        if self.profile:
            out["cluster.profile"] = self.profile
        return out

    @property
    def sim_set(self) -> dict:
        return {"cluster.profile": self.profile} if self.profile else {}

    def sweep(self, name: str, base: Scenario, **kw) -> Sweep:
        """A sweep with this command line's backends, repeats and measured side."""
        return Sweep(name, base, backends=self.backends, repeats=self.repeats, real_set=self.real_set,
                     sim_set=self.sim_set, **kw)
