"""What the emulated cluster sets in each namespace and on each link, with the reasons.

Units: rates in bits/s (what ``tc`` takes), sizes in bytes, times in seconds.

- ``SYSCTLS``: kernel settings written through ``/proc/sys`` inside each namespace before
  any interface exists there (new interfaces copy the ``default`` values when made);
- the ``htb`` shaping figures of every veth egress: the link's rate, a priority lane for
  small packets, one fair-queued class per flow crossing the link, the ``burst`` and
  ``quantum`` of the classes and the byte limit of each flow's ``bfifo``.
"""

from __future__ import annotations

from typing import NamedTuple


class Sysctl(NamedTuple):
    """One kernel setting of a namespace."""

    path: str  # below /proc/sys
    value: str
    where: str  # "every" namespace, or "rank" namespaces only
    why: str
    optional: bool = False  # skipped when the kernel lacks the setting (IPv6 compiled out)


SYSCTLS: tuple[Sysctl, ...] = (
    Sysctl("net/ipv4/conf/all/rp_filter", "0", "every",
           "a rank's address sits on its NIC, but packets from ranks of its node arrive on the "
           "NVLink interface: reverse-path filtering would drop them"),
    Sysctl("net/ipv4/conf/default/rp_filter", "0", "every",
           "the same for interfaces made after this write (every veth end and bridge)"),
    Sysctl("net/ipv6/conf/all/disable_ipv6", "1", "every",
           "no IPv6 chatter (DAD, router solicitations, MLD) on the emulated wires: the link "
           "counters carry the job's traffic and ARP only", optional=True),
    Sysctl("net/ipv6/conf/default/disable_ipv6", "1", "every",
           "the same for interfaces made after this write", optional=True),
    Sysctl("net/ipv4/tcp_slow_start_after_idle", "0", "rank",
           "collectives are bursts separated by compute: a connection keeps its window over "
           "the idle gap instead of falling back to slow start at every step"),
    Sysctl("net/ipv4/tcp_no_metrics_save", "1", "rank",
           "no window or RTT remembered from an earlier connection to the same address "
           "(an earlier run, or a test): every run starts alike"),
    Sysctl("net/ipv4/tcp_autocorking", "0", "rank",
           "small messages (headers, acknowledgements of a collective) go out at once "
           "instead of waiting to be merged with later writes"),
)

#: htb quantum: how much a class may send per round among classes of one priority; 64 KiB
#: takes a whole GSO super-packet, and an explicit value keeps tc from warning that the
#: quantum derived from r2q is out of range
HTB_QUANTUM = 65536
#: htb burst floor, bytes: small, so that a class idle for a while cannot send much faster
#: than its rate (htb lets a packet go whenever a class's tokens are positive, so a 64 KiB
#: super-packet still passes, and the rate holds on average)
BURST_MIN = 16 * 1024
#: htb burst in time of the link's rate: at high rates the shaper's timer granularity
#: would otherwise cap the rate below the link's
BURST_TIME = 0.25e-3
#: the priority lane: packets shorter than 128 bytes (IP total length & 0xff80 == 0):
#: TCP acknowledgements and gloo's rendezvous messages. Without it an acknowledgement
#: waits behind the data queued in the other direction of a busy link; the round trip
#: grows by that queue and a window-limited connection slows down (measured: two ranks
#: exchanging 8 MiB took twice as long as one sending it).
SMALL_CLASS = 2
SMALL_MASK = 0xFF80
SMALL_SHARE = 0.05  # of the link guaranteed to small packets (they borrow the rest)
SMALL_QUEUE = 256 * 1024
#: flow classes start here: one per (source, destination) rank pair crossing the link, each
#: with an equal share of the link and the whole link to borrow (htb shares spare rate
#: round-robin among backlogged classes): per-flow fair queueing, as the max-min model
#: assumes. One FIFO for all flows instead makes TCP flows sharing two links in series
#: finish unevenly (measured: an all-to-all of 3 ranks over the NICs 20% slower).
FIRST_FLOW_CLASS = 16
#: default bfifo limit of each flow's queue: deep enough that TCP fills it without losses
#: (a lossless fabric, as RDMA fabrics are); a lost packet costs TCP a 200 ms timeout,
#: longer than a collective
QUEUE_PER_FLOW = 8 * 2**20
#: tc passes burst and queue limits as 32-bit fields; stay below the signed limit
SIZE_MAX = 2**31 - 1


def burst_bytes(rate_bits: int) -> int:
    """htb burst (and cburst) of a class at ``rate_bits`` bits/s."""
    return min(SIZE_MAX, max(BURST_MIN, int(rate_bits / 8 * BURST_TIME)))


def default_queue_bytes(rate_bits: int) -> int:
    """bfifo limit of each flow's queue on a link at ``rate_bits`` bits/s when none is given."""
    return QUEUE_PER_FLOW
