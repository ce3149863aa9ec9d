"""Named network namespaces from Python: entering one, listing them, and whether we may.

``ip netns add NAME`` keeps a namespace alive by a bind mount at ``/var/run/netns/NAME``;
a process joins it with ``setns(2)`` on that file (Python 3.11 has no ``os.setns``, so
through ``ctypes``). Making namespaces, veths and qdiscs needs CAP_SYS_ADMIN (mounts,
setns) and CAP_NET_ADMIN (links, addresses, qdiscs), and the ``ip`` and ``tc`` tools.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

from real.netem.plan import NAMESPACE_PREFIX
from testbed.core.errors import ScenarioError

NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21


def enter_namespace(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (``/var/run/netns/<name>``).

    For a rank process, in its main thread before it starts threads or opens sockets
    (threads started later inherit the namespace; those already running keep theirs).
    Raises OSError with the errno's text on failure.
    """
    if not name.startswith(NAMESPACE_PREFIX) or "/" in name:
        raise OSError(errno.EINVAL, f"not a testbed network namespace: {name!r}")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def join_rank_network(netns: tuple[str, str] | None) -> None:
    """A rank process of an emulated cluster joins its network: enters its namespace and
    has gloo bind to its NIC interface (``EmulatedFabric.rank_network``). None: stay put."""
    if netns is not None:
        enter_namespace(netns[0])
        os.environ["GLOO_SOCKET_IFNAME"] = netns[1]


def existing_namespaces() -> list[str]:
    """Names of the testbed's namespaces on this machine (``testbed-*`` only), sorted."""
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(NAMESPACE_PREFIX))
    except FileNotFoundError:
        return []


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def privileges_missing() -> str | None:
    """Why this process cannot make an emulated cluster, or None when it can."""
    try:
        caps = _effective_caps()
    except OSError as e:
        return f"cannot read /proc/self/status ({e.strerror}) to check capabilities"
    lacking = [name for name, bit in (("CAP_NET_ADMIN", CAP_NET_ADMIN), ("CAP_SYS_ADMIN", CAP_SYS_ADMIN))
               if not caps >> bit & 1]
    if lacking:
        return (f"making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); "
                f"this process lacks {' and '.join(lacking)}")
    tools = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if tools:
        return f"{' and '.join(tools)} not found on PATH (install iproute2)"
    return None


def check_privileges() -> None:
    """Raise ScenarioError("real.network", "emulated", reason) unless we can emulate."""
    reason = privileges_missing()
    if reason is not None:
        raise ScenarioError("real.network", "emulated", reason)
