"""An emulated cluster: the scenario's ranks in network namespaces joined like the simulator's fabric.

``EmulatedFabric(scenario, profile)`` builds the plan (``real.netem.plan``) and does
nothing else; ``up()`` makes it, ``down()`` removes it, and ``with`` does both. A rank
process joins its namespace with ``enter_namespace(fabric.rank_namespace(r))`` and
talks over ``rank_interface(r)`` (gloo: ``GLOO_SOCKET_IFNAME``) to ``rank_address(p)``.
Every direction of every link is shaped to its block's rate (bits/s in ``links()``);
``counters()`` gives the bytes each one carried, headers included.

Making it (``up``), each stage one process per namespace, all run together:

1. the host's ``ip -batch``: ``netns add`` for every namespace (nothing else in the host);
2. ``ip netns exec NS sh``: the ``SYSCTLS``, before any interface exists so that new
   interfaces copy the ``default`` values;
3. ``ip -n NS -batch``: bridges, veth pairs (made in one namespace with the peer sent to
   the other), ``lo`` up, the rank's address;
4. ``ip -n NS -batch``: bridge ports, interfaces up, routes; ``tc -n NS -batch``: shaping.

A registry file names the owner before stage 1 (``real.netem.registry``), so that the
leftovers of an owner killed with SIGKILL can be found and removed (``real.netem.cleanup``).
Latency is not emulated (no netem qdisc): links are rate-limited, with the queueing delay
of their ``bfifo``.
"""

from __future__ import annotations

import json
import time
from contextlib import suppress
from pathlib import Path

from real.netem import registry
from real.netem.commands import in_namespace, ip_batch, qdisc_stats, run_all, tc_batch
from real.netem.nsenter import NETNS_DIR, check_privileges, existing_namespaces
from real.netem.plan import Egress, Plan, build_plan
from testbed.core.errors import RunError


class EmulatedFabric:
    """The emulated cluster of one scenario (see the module doc)."""

    def __init__(self, scenario, profile, run_id: str | None = None, queue_bytes: int | None = None):
        self.plan: Plan = build_plan(scenario.cluster, profile, run_id, queue_bytes)
        self.run_id: str = self.plan.run_id
        self.namespaces: list[str] = list(self.plan.namespaces)
        #: seconds of the last up() and down(), for reports
        self.timings: dict[str, float] = {}
        self._made = False  # namespaces may exist that this object must remove

    def __repr__(self) -> str:
        state = "up" if self._made else "down"
        return (f"EmulatedFabric({self.run_id}, {len(self.plan.rank_namespaces)} ranks, "
                f"{len(self.namespaces)} namespaces, {state})")

    # ---- names -----------------------------------------------------------------------
    def rank_namespace(self, rank: int) -> str:
        return self.plan.rank_namespaces[rank]

    def rank_interface(self, rank: int) -> str:
        """The rank's NIC interface: what GLOO_SOCKET_IFNAME must name."""
        return self.plan.rank_interfaces[rank]

    def rank_network(self, rank: int) -> tuple[str, str]:
        """(namespace, NIC interface) a rank process joins (``join_rank_network``)."""
        return self.rank_namespace(rank), self.rank_interface(rank)

    def rank_address(self, rank: int) -> str:
        return self.plan.addresses[rank]

    def links(self) -> list[Egress]:
        """One row per shaped egress: (block, index, namespace, interface, rate bits/s)."""
        return self.plan.egresses()

    # ---- life cycle ------------------------------------------------------------------
    def up(self) -> "EmulatedFabric":
        """Make every namespace, link, address, route and qdisc; on failure remove them and raise RunError."""
        if self._made:
            return self
        check_privileges()
        taken = sorted(set(self.namespaces) & set(existing_namespaces()))
        if taken:
            raise RunError(f"emulated cluster {self.run_id}: namespace {taken[0]} already exists (run id in use)")
        start = time.perf_counter()
        try:
            registry.write(self.run_id, self.namespaces)
        except OSError as e:
            raise RunError(f"emulated cluster {self.run_id}: cannot write its registry file: {e}") from None
        self._made = True
        try:
            self._make()
        except BaseException:
            # the first error says more; what down() cannot remove stays in the registry for clean()
            with suppress(RunError):
                self.down()
            raise
        self.timings["up_s"] = time.perf_counter() - start
        return self

    def _make(self) -> None:
        plan = self.plan
        have_ipv6 = Path("/proc/sys/net/ipv6").is_dir()
        run_all([ip_batch(plan.netns_add_batch())])
        run_all([in_namespace(ns, plan.sysctl_script(ns, have_ipv6)) for ns in plan.namespaces])
        run_all([ip_batch(text, ns) for ns in plan.namespaces if (text := plan.create_batch(ns))])
        run_all([ip_batch(text, ns) for ns in plan.namespaces if (text := plan.wire_batch(ns))]
                + [tc_batch(text, ns) for ns in plan.namespaces if (text := plan.shape_batch(ns))])

    def down(self) -> None:
        """Remove every namespace this object made (their veths and qdiscs go with them)
        and the registry file. Idempotent. Processes still inside keep running, cut off."""
        if not self._made:
            return
        start = time.perf_counter()
        mine = [ns for ns in self.namespaces if (NETNS_DIR / ns).exists()]
        if mine:
            # -force: a namespace that cannot be removed does not keep the others
            run_all([ip_batch(Plan.netns_del_batch(mine), force=True)])
        registry.remove(self.run_id)
        self._made = False
        self.timings["down_s"] = time.perf_counter() - start

    def __enter__(self) -> "EmulatedFabric":
        return self.up()

    def __exit__(self, *exc) -> bool:
        self.down()
        return False

    # ---- measurement -----------------------------------------------------------------
    def counters(self) -> dict[tuple[str, int], int]:
        """Bytes sent so far through each shaped egress, keyed by (block, index).

        Read from the root htb qdisc of each interface (one ``tc`` per namespace, run
        together). The bytes are what the emulated wire carried: Ethernet, IP and TCP
        headers included, ARP too.
        """
        if not self._made:
            raise RunError(f"emulated cluster {self.run_id} is not up")
        by_device = self.plan.by_device()
        out = {(e.block, e.index): 0 for e in by_device.values()}
        namespaces = sorted({ns for ns, _ in by_device}, key=self.namespaces.index)
        for ns, text in zip(namespaces, run_all([qdisc_stats(ns) for ns in namespaces])):
            for qdisc in json.loads(text or "[]"):
                egress = by_device.get((ns, qdisc.get("dev")))
                if egress is not None and qdisc.get("kind") == "htb" and qdisc.get("root"):
                    out[(egress.block, egress.index)] = int(qdisc["bytes"])
        return out
