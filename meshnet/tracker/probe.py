"""Reachability probes: can the tracker connect to the endpoint a node advertises?

A node registers with the URL others should use to reach it; nothing proves that URL
works until someone connects. The tracker checks it with ``GET {endpoint}/v1/health``
(short timeout) at registration, again every ``probe_interval_s`` while it fails, and
after a hop failure is reported. Only a node whose probe succeeded is *reachable*, and
only a reachable node's shards are admitted (coverage, routes) or given new placements
(docs/adr/0031-hop-failures-and-session-admission.md).
"""

from __future__ import annotations

import httpx

__all__ = ["answers_as", "probe_endpoint"]


async def probe_endpoint(http: httpx.AsyncClient, endpoint: str, node_id: str, timeout_s: float) -> str:
    """Probe ``GET {endpoint}/v1/health`` within ``timeout_s`` seconds (connect and answer).

    A node answers as itself: a JSON body whose ``node_id`` is another node's means the
    endpoint points elsewhere. Any status is accepted from the right node (a draining or
    starting node is reachable); without a ``node_id`` the answer must be 200.

    Returns:
        ``""`` when reachable, else why not (one line, for ``meshnet nodes`` and the node's log).
        Never raises for a network or protocol error.
    """
    url = f"{endpoint}/v1/health"
    status, answered, failed = await _health(http, url, timeout_s)
    if failed:
        return failed
    if answered is not None and answered != node_id:
        return f"GET {url} answered as node {answered!r}, not {node_id!r}"
    if answered is None and status != 200:
        return f"GET {url} answered HTTP {status}"
    return ""


async def answers_as(http: httpx.AsyncClient, endpoint: str, node_id: str, timeout_s: float) -> bool:
    """Whether ``GET {endpoint}/v1/health`` answers, within ``timeout_s`` seconds, with a body that
    names ``node_id``: a live process of that node is there. Never raises."""
    return (await _health(http, f"{endpoint}/v1/health", timeout_s))[1] == node_id


async def _health(http: httpx.AsyncClient, url: str, timeout_s: float) -> tuple[int, str | None, str]:
    """One ``GET`` of a health ``url``: its status, the ``node_id`` its JSON body names (None: no
    such body) and, when it could not be asked at all, why (else ``""``). Never raises."""
    try:
        resp = await http.get(url, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - refused, timed out, bad URL...: all mean unreachable
        return 0, None, f"GET {url} failed: {type(exc).__name__}: {exc}"[:500]
    try:
        body = resp.json()
    except ValueError:
        body = None
    return resp.status_code, body.get("node_id") if isinstance(body, dict) else None, ""
