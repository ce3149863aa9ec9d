"""Errors the testbed reports to a user as one line (the CLI exits with code 2)."""

from __future__ import annotations


class ScenarioError(ValueError):
    """A scenario field holds a value the testbed cannot run.

    ``field`` is the dotted path (``router.capacity_factor``), ``value`` what the user
    gave, ``reason`` what is wrong with it. ``str()`` is the one line the CLI prints.
    """

    def __init__(self, field: str, value: object, reason: str):
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field} = {value!r}: {reason}")


class RunError(RuntimeError):
    """A run could not complete (a rank died, a trace does not fit the scenario, ...)."""
