"""Endpoints (meshnet.endpoints): bracketed IPv6 URLs, endpoint checks, free ports on either family."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from meshnet.cli.main import app
from meshnet.endpoints import base_url, check_endpoint, free_port
from meshnet.errors import InvalidRequest
from meshnet.node.settings import NodeSettings


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host, url", [("127.0.0.1", "http://127.0.0.1:8821"), ("::1", "http://[::1]:8821"),
                                       ("[::1]", "http://[::1]:8821"), ("fe80::1%eth0", "http://[fe80::1%eth0]:8821"),
                                       ("node-a.example", "http://node-a.example:8821")])
def test_base_url_brackets_ipv6_literals(host, url):
    assert base_url(host, 8821) == url


def test_node_endpoint_on_ipv6_is_bracketed():
    assert NodeSettings(host="::1", port=8821).endpoint == "http://[::1]:8821"
    assert NodeSettings(host="::1", port=8821, public_url="https://n.example/x").endpoint == "https://n.example/x"


@pytest.mark.parametrize("url", ["http://127.0.0.1:8821", "http://[::1]:8821/", "https://node.example/prefix"])
def test_usable_endpoints_pass_without_a_trailing_slash(url):
    assert check_endpoint(url) == url.rstrip("/")


@pytest.mark.parametrize("url, why", [("http://::1:8821", "Invalid port"), ("ftp://n:1", "scheme"),
                                      ("http://:80", "no host"), ("http://n:99999", "port 99999"),
                                      ("http://n:1/?a=1", "query"), ("http://a b:1", "whitespace"),
                                      ("127.0.0.1:8821", "scheme"), ("", "empty")])
def test_unusable_endpoints_are_422_naming_the_reason(url, why):
    with pytest.raises(InvalidRequest, match=why) as info:
        check_endpoint(url)
    assert info.value.status == 422 and info.value.code == "invalid_endpoint"
    assert "[::1]" in info.value.hint


def test_free_port_on_ipv4():
    port = free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_free_port_on_ipv6_loopback_binds_for_real():
    port = free_port("::1")
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))


def test_free_port_on_an_unknown_host_is_an_os_error():
    with pytest.raises(OSError):
        free_port("no-such-host.invalid")


def test_node_start_rejects_an_unbracketed_ipv6_public_url():
    result = CliRunner().invoke(app, ["node", "start", "--public-url", "http://::1:8821"])
    assert result.exit_code == 1
    assert "is not a usable base URL" in result.output and "http://[::1]:8821" in result.output


def test_node_start_on_a_host_that_does_not_resolve_is_a_clean_error():
    result = CliRunner().invoke(app, ["node", "start", "--host", "no-such-host.invalid"])
    assert result.exit_code == 1
    assert "cannot pick a free port on --host no-such-host.invalid" in result.output


def test_cli_url_that_is_not_a_url_is_a_clean_error():
    result = CliRunner().invoke(app, ["nodes", "--url", "http://::1:8700"])
    assert result.exit_code == 1 and "is not a usable base URL" in result.output


def test_node_start_flags_and_env_reach_the_settings(monkeypatch):
    import meshnet.cli.services as services
    import meshnet.node.app as node_app

    seen = {}
    monkeypatch.setattr(node_app, "build_app", lambda settings: seen.setdefault("settings", settings))
    monkeypatch.setattr(services, "_serve", lambda app, host, port: seen.update(host=host, port=port))
    result = CliRunner().invoke(app, ["node", "start", "--host", "::1", "--session-ttl", "42",
                                      "--hop-connect-timeout", "1.5", "--hop-timeout", "30", "--wallet", "w1"],
                                env={"MESHNET_SESSION_CACHE_MB": "64"})
    assert result.exit_code == 0, result.output
    s = seen["settings"]
    assert (s.session_cache_bytes, s.session_ttl_s) == (64 * 1024 * 1024, 42.0)
    assert (s.hop_timeout_s, s.hop_connect_timeout_s, s.wallet) == (30.0, 1.5, "w1")
    assert seen["host"] == "::1" and seen["port"] > 0 and s.endpoint == f"http://[::1]:{seen['port']}"
    assert f"listening on http://[::1]:{seen['port']}" in result.output
