"""Emulated cluster network: each rank in its own Linux network namespace, joined like the simulator's fabric.

The links of ``testbed.scenario.links`` (NVLink to a node's switch, NIC to a micro-cluster's
leaf, leaf to spine) become veth pairs between namespaces, bridges stand for switches,
and ``htb`` shapes every direction to its block's rate, so the real backend's gloo
traffic crosses the same links at the same rates as the simulator's flows. Needs root
(CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; nothing is made in or attached to the
host's namespace.

- ``plan``: names, addresses, links and command batches (pure);
- ``fabric``: ``EmulatedFabric``, making and removing a cluster, link counters;
- ``nsenter``: ``enter_namespace`` for rank processes, privilege checks;
- ``registry`` / ``cleanup``: who owns which cluster; removing what dead owners left;
- ``commands``: running ``ip`` and ``tc``; ``settings``: sysctls and shaping figures.
"""

from real.netem.cleanup import clean, leftovers
from real.netem.fabric import EmulatedFabric
from real.netem.nsenter import check_privileges, enter_namespace, join_rank_network, privileges_missing
from real.netem.plan import Egress

__all__ = ["EmulatedFabric", "Egress", "check_privileges", "clean", "enter_namespace", "join_rank_network", "leftovers",
           "privileges_missing"]
