"""Which process owns which emulated cluster: one JSON file per run.

``EmulatedFabric.up`` writes ``/run/testbed-net/<id>.json`` (``/tmp/testbed-net`` when
``/run`` is not writable) before it makes anything, and ``down`` removes it. A file holds
``run_id``, ``owner_pid``, ``owner_start`` (the owner's start time in clock ticks since
boot, field 22 of ``/proc/<pid>/stat``: a recycled pid has another one), ``created``
(Unix time, s) and ``namespaces``. ``cleanup`` reads them to tell live runs from the
leftovers of an owner that was killed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from real.netem.plan import RUN_ID_RE

#: where registry files go, first writable one wins; both are read
DIRECTORIES = (Path("/run/testbed-net"), Path("/tmp/testbed-net"))


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks after boot), or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    fields = stat[stat.rindex(")") + 2:].split()
    state, start = fields[0], int(fields[19])  # fields 3 and 22
    # a killed owner its parent has not reaped yet is a zombie: it owns nothing any more
    return None if state in ("Z", "X") else start


def owner_alive(entry: dict) -> bool:
    """Whether the process that wrote ``entry`` still runs (same pid, same start time)."""
    pid, start = entry.get("owner_pid"), entry.get("owner_start")
    return isinstance(pid, int) and start is not None and process_start(pid) == start


def write(run_id: str, namespaces: list[str]) -> Path:
    """Record this process as owner of ``run_id``; return the file written."""
    entry = {"run_id": run_id, "owner_pid": os.getpid(), "owner_start": process_start(os.getpid()),
             "created": time.time(), "namespaces": list(namespaces)}
    errors = []
    for directory in DIRECTORIES:
        try:
            directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            path = directory / f"{run_id}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entry, indent=1))
            tmp.replace(path)  # whole or nothing: a reader never sees half a file
            return path
        except OSError as e:
            errors.append(f"{directory}: {e.strerror}")
    raise OSError(f"no writable registry directory ({'; '.join(errors)})")


def read_all() -> dict[str, tuple[Path, dict]]:
    """run id -> (file, entry) for every readable registry file."""
    out: dict[str, tuple[Path, dict]] = {}
    for directory in DIRECTORIES:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            run_id = name.removesuffix(".json")
            if not name.endswith(".json") or not RUN_ID_RE.match(run_id) or run_id in out:
                continue
            path = directory / name
            try:
                entry = json.loads(path.read_text())
            except (OSError, ValueError):
                entry = {}  # unreadable: treated as a dead owner's
            out[run_id] = (path, entry if isinstance(entry, dict) else {})
    return out


def remove(run_id: str) -> None:
    """Delete ``run_id``'s registry files (there is normally one)."""
    for directory in DIRECTORIES:
        try:
            (directory / f"{run_id}.json").unlink()
        except FileNotFoundError:
            pass
