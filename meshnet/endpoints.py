"""Endpoints: the base URLs nodes advertise and services listen on (IPv4, IPv6, names).

One place builds a URL from a host and a port (an IPv6 literal needs brackets:
``http://[::1]:8821``), checks an advertised URL before anyone connects to it, and finds
a free port on a host of either family. Imports neither torch nor the services.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import httpx

from meshnet.errors import InvalidRequest

__all__ = ["base_url", "check_endpoint", "check_endpoints", "free_port", "url_host"]


def url_host(host: str) -> str:
    """``host`` as it goes in a URL: an IPv6 literal in brackets (``::1`` → ``[::1]``), others as they are."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def base_url(host: str, port: int, scheme: str = "http") -> str:
    """``scheme://host:port`` with an IPv6 ``host`` bracketed, e.g. ``base_url("::1", 8821)`` → ``http://[::1]:8821``."""
    return f"{scheme}://{url_host(host)}:{port}"


def check_endpoint(url: str) -> str:
    """Validate a node's advertised base URL; returns it without a trailing ``/``.

    Accepts ``http``/``https`` with a host and an optional port in 1..65535 and path prefix.

    Raises:
        InvalidRequest (422 ``invalid_endpoint``): unparsable (e.g. an unbracketed IPv6
            literal ``http://::1:8821``), another scheme, no host, a bad port, a query or fragment.
    """
    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"endpoint {url!r} is not a usable base URL: {why}", code="invalid_endpoint",
                              status=422, hint="use http://HOST:PORT; an IPv6 address goes in brackets, "
                                               "e.g. http://[::1]:8821")

    if not url or any(c.isspace() for c in url):
        raise bad("empty or contains whitespace")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise bad(str(exc)) from None
    if parsed.scheme not in ("http", "https"):
        raise bad(f"scheme must be http or https, not {parsed.scheme or 'missing'!r}")
    if not parsed.host:
        raise bad("no host")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise bad(f"port {parsed.port} outside 1..65535")
    if parsed.query or parsed.fragment:
        raise bad("a base URL has no query or fragment")
    return url.rstrip("/")


def check_endpoints(urls: str | Sequence[str]) -> list[str]:
    """Several base URLs (every tracker of one database, ADR-0043), given as a list or one string
    separated by commas; each checked by :func:`check_endpoint`, duplicates dropped, order kept.

    Raises:
        InvalidRequest (422 ``invalid_endpoint``): none given, or one that is not a usable base URL.
    """
    parts = [urls] if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for part in parts:
        for url in part.split(","):
            url = check_endpoint(url.strip())
            if url not in out:
                out.append(url)
    if not out:
        raise InvalidRequest("no URL given", code="invalid_endpoint", status=422,
                             hint="pass one URL, or several separated by commas")
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (IPv4 or IPv6 address, or a name).

    Raises:
        OSError: ``host`` does not resolve or cannot be bound (``socket.gaierror`` is one).
    """
    family, socktype, proto, _, addr = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socktype, proto) as s:
        s.bind(addr)
        return s.getsockname()[1]
