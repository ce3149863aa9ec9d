"""Running ``ip`` and ``tc``: batches on stdin, many namespaces at once, one-line errors.

A cluster is made by a few stages of commands, each stage one process per namespace
(``ip -n NS -batch -``, ``tc -n NS -batch -``) started together and waited for together:
the processes are independent, so a stage costs about one process's time. Every exit
status is checked; a failure becomes a ``RunError`` naming the command, the batch line
that failed (``ip``/``tc`` report ``Command failed -:N``) and the tool's stderr, all on
one line.
"""

from __future__ import annotations

import re
import subprocess
from typing import NamedTuple, Sequence

from testbed.core.errors import RunError

#: no ip/tc call of a cluster of a few dozen namespaces should take near this long
TIMEOUT_S = 30.0
_FAILED_LINE = re.compile(r"Command failed -:(\d+)")


class Command(NamedTuple):
    """One process: its argv and the text fed on stdin (a batch, or nothing)."""

    argv: tuple[str, ...]
    stdin: str = ""

    def __str__(self) -> str:
        return " ".join(self.argv).replace("\n", "; ")


def _describe(command: Command, returncode: int, stderr: str) -> str:
    """``ip -n X -batch -`` failed (exit 1) at `link add ...`: Error: ... -- one line."""
    where = ""
    match = _FAILED_LINE.search(stderr)
    if match and command.stdin:
        lines = command.stdin.splitlines()
        n = int(match.group(1))
        if 1 <= n <= len(lines):
            where = f" at `{lines[n - 1]}`"
    text = "; ".join(line.strip() for line in stderr.splitlines()
                     if line.strip() and not _FAILED_LINE.search(line)) or "no message"
    return f"`{command}` failed (exit {returncode}){where}: {text}"


def run_all(commands: Sequence[Command], check: bool = True, timeout: float = TIMEOUT_S) -> list[str]:
    """Run ``commands`` concurrently; return their stdouts in order.

    With ``check``, raise ``RunError`` for the first command (in order) that failed,
    after all have finished.
    """
    procs = []
    try:
        for c in commands:
            try:
                procs.append(subprocess.Popen(
                    c.argv, stdin=subprocess.PIPE if c.stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            except OSError as e:
                raise RunError(f"cannot run `{c}`: {e.strerror}") from None
        results = []
        for p, c in zip(procs, commands):
            try:
                results.append(p.communicate(c.stdin or None, timeout=timeout))
            except subprocess.TimeoutExpired:
                raise RunError(f"`{c}` did not finish in {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if check:
        for c, p, (_, err) in zip(commands, procs, results):
            if p.returncode != 0:
                raise RunError(_describe(c, p.returncode, err))
    return [out for out, _ in results]


def ip_batch(text: str, namespace: str | None = None, force: bool = False) -> Command:
    """``ip [-n NS] [-force] -batch -`` fed ``text``; ``-force`` goes on after a failed line."""
    argv = ("ip",) + (("-n", namespace) if namespace else ()) + (("-force",) if force else ()) + ("-batch", "-")
    return Command(argv, text)


def tc_batch(text: str, namespace: str) -> Command:
    return Command(("tc", "-n", namespace, "-batch", "-"), text)


def in_namespace(namespace: str, script: str) -> Command:
    """``ip netns exec NS sh -ec SCRIPT``: a shell inside the namespace, stopping at an error."""
    return Command(("ip", "netns", "exec", namespace, "sh", "-ec", script))


def qdisc_stats(namespace: str) -> Command:
    """``tc -n NS -s -j qdisc show``: every qdisc of the namespace with its counters, JSON."""
    return Command(("tc", "-n", namespace, "-s", "-j", "qdisc", "show"))
