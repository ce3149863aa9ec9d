"""Finding and removing emulated clusters whose owner died (killed with SIGKILL, a crash).

A run is known by its namespaces (``testbed-<id>-rank0`` ...) and its registry file
(``real.netem.registry``). Its owner is alive when the registry's pid still runs with the
recorded start time; namespaces without a registry file belong to a dead owner (``up``
writes the file before it makes anything). ``clean`` kills, by pid and with SIGKILL,
the processes still inside a dead run's namespaces (rank processes would otherwise keep
the kernel's namespace, and their memory, alive), then deletes the namespaces and the
registry file. Only names of the form ``testbed-<6 hex>-<rank|node|leaf|spine>`` are
ever touched.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

from real.netem import registry
from real.netem.commands import ip_batch, run_all
from real.netem.nsenter import NETNS_DIR, existing_namespaces
from real.netem.plan import NAMESPACE_RE, Plan
from testbed.core.errors import RunError


def leftovers() -> list[dict]:
    """Every emulated cluster on this machine, live or not, by run id.

    Each: ``run_id``, ``owner_pid`` (None without a registry file), ``owner_alive``,
    ``created`` (Unix time or None), ``namespaces`` (those that exist now, sorted) and
    ``registry`` (the file's path or None).
    """
    found: dict[str, list[str]] = {}
    for ns in existing_namespaces():
        match = NAMESPACE_RE.match(ns)
        if match:
            found.setdefault(match.group(1), []).append(ns)
    files = registry.read_all()
    out = []
    for run_id in sorted(set(found) | set(files)):
        path, entry = files.get(run_id, (None, {}))
        out.append({
            "run_id": run_id,
            "owner_pid": entry.get("owner_pid"),
            "owner_alive": registry.owner_alive(entry),
            "created": entry.get("created"),
            "namespaces": found.get(run_id, []),
            "registry": str(path) if path else None,
        })
    return out


def processes_in(namespaces: Iterable[str]) -> list[int]:
    """Pids with a thread inside one of ``namespaces`` (what ``ip netns pids`` finds, in one pass)."""
    targets = set()
    for ns in namespaces:
        try:
            st = os.stat(NETNS_DIR / ns)
            targets.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    pids = []
    for name in os.listdir("/proc") if targets else []:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            # a thread may have entered alone (setns moves only the calling thread)
            tasks = os.listdir(f"/proc/{name}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                st = os.stat(f"/proc/{name}/task/{tid}/ns/net")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in targets:
                pids.append(int(name))
                break
    return pids


def clean(force: bool = False, only: Iterable[str] | None = None) -> list[str]:
    """Remove the clusters of dead owners (every one with ``force``); return the namespaces removed.

    ``only`` restricts the sweep to those run ids. A live owner's cluster is kept unless
    ``force``.
    """
    wanted = None if only is None else set(only)
    runs = [r for r in leftovers()
            if (wanted is None or r["run_id"] in wanted) and (force or not r["owner_alive"])]
    doomed = [ns for r in runs for ns in r["namespaces"]]
    for pid in processes_in(doomed):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if doomed:
        run_all([ip_batch(Plan.netns_del_batch(doomed), force=True)], check=False)
    left = set(existing_namespaces()) & set(doomed)
    for r in runs:
        if not left & set(r["namespaces"]):
            registry.remove(r["run_id"])
    if left:
        raise RunError(f"could not remove namespace(s) {', '.join(sorted(left))}")
    return doomed
