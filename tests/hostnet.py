"""Picking addresses for the tests' own network namespaces (veth pairs) that this host does not
route already.

Two veth pairs given the same subnet break each other: the host holds the outer address on both
links and sends every reply by the first route, into the other pair, so connections from the new
namespace time out. A pair left behind by a killed run (its ``finally`` never ran) or made by
another run on the same machine must not be chosen again.
"""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Iterable


def routed_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this host has a route or an address for (``ip -4 route``, ``ip -4 addr``).

    Raises:
        subprocess.CalledProcessError: ``ip`` failed; FileNotFoundError: it is not installed.
    """
    nets = []
    for args in (["-4", "-o", "route", "show", "table", "all"], ["-4", "-o", "addr", "show"]):
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=True).stdout
        for line in out.splitlines():
            words = line.split()
            word = words[0] if args[2] == "route" else words[3]  # "N: dev inet A/P ..." for addresses
            if word in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
                word = words[1]
            try:
                nets.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    return nets


def free_subnet(candidates: Iterable[str]) -> ipaddress.IPv4Network:
    """The first of ``candidates`` (CIDR strings) that overlaps nothing this host routes.

    Raises:
        RuntimeError: every candidate is taken (leftover namespaces: ``ip netns list``).
    """
    taken = routed_networks()
    for text in candidates:
        net = ipaddress.ip_network(text)
        if not any(net.overlaps(other) for other in taken if other.prefixlen > 0):
            return net
    raise RuntimeError("no free subnet for a test namespace: every candidate is routed here "
                       "(leftovers of killed runs? `ip netns list`, `ip -4 route`)")
