"""The test namespaces' subnet choice (tests/hostnet.py): a subnet this host routes already is
never chosen again (a leftover veth pair on it would take the new pair's replies)."""

from __future__ import annotations

import ipaddress

import pytest

from tests import hostnet


def test_a_routed_subnet_is_skipped_and_the_next_free_one_chosen(monkeypatch):
    monkeypatch.setattr(hostnet, "routed_networks", lambda: [
        ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("10.213.236.0/30"),
        ipaddress.ip_network("10.213.237.1/32")])
    got = hostnet.free_subnet(["10.213.236.0/30", "10.213.237.0/30", "10.213.238.0/30"])
    assert got == ipaddress.ip_network("10.213.238.0/30")


def test_no_free_subnet_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(hostnet, "routed_networks", lambda: [ipaddress.ip_network("10.0.0.0/8")])
    with pytest.raises(RuntimeError, match="no free subnet"):
        hostnet.free_subnet(["10.213.200.0/30"])
