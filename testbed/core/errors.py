"""Errors the testbed reports to a user as one line (the CLI exits with code 2)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager


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

    def __reduce__(self):
        # rebuilt from its three parts when it crosses a process (a sweep's worker), not from str()
        return (ScenarioError, (self.field, self.value, self.reason))


class RunError(RuntimeError):
    """A run could not complete (a rank died, a trace does not fit the scenario, ...)."""


@contextmanager
def signals_stop_work(*signums: int):
    """While inside, the given signals (SIGTERM by default) raise KeyboardInterrupt in the
    main thread, so that work they stop unwinds as on Ctrl-C: a run is marked stopped, an
    emulated cluster is torn down. Elsewhere than the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, stop) for sig in (signums or (signal.SIGTERM,))}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_as_command(prog: str, work, stopped: str) -> int:
    """Run ``work()`` for a command-line tool and return its exit code.

    A ``ScenarioError`` or ``RunError`` prints ``PROG: error: ...`` as one line and
    gives 2; Ctrl-C (or SIGTERM, which stops the work the same way, so that a stopped run
    is marked as such) prints ``PROG: <stopped>`` and gives 130; output into a closed pipe
    (``testbed run ... | head``) prints one line and gives 141, as a shell reports SIGPIPE.
    """
    try:
        with signals_stop_work():
            return work()
    except (ScenarioError, RunError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: {stopped}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away: say so once, and keep Python from a second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"{prog}: output pipe closed by its reader", file=sys.stderr)
        return 141
