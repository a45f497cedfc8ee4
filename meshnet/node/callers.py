"""Who may call a node, and what they may see (ADR-0035, ADR-0038, ADR-0049).

- A hop call (``POST /v1/forward``, a stream's OPEN) goes through one admission
  (:func:`admit_hop`): the session's ticket naming this node for exactly the asked layers, and
  for a new session no earlier release of it and no drain.
- A release needs the session's ticket and a call signed by the entry node it names
  (:func:`check_release`).
- Session ids in ``/v1/traffic`` are shown only to a call signed by the node's tracker
  (:func:`asked_by_tracker`).

A node without a tracker key (tests, a standalone node) checks none of these.
"""

from __future__ import annotations

from typing import Protocol

import torch

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from starlette.requests import Request
from starlette.types import Scope

from meshnet.drain import Drain
from meshnet.errors import Forbidden, InvalidRequest, SessionConflict, Unauthorized
from meshnet.layers import LayerRange
from meshnet.node.settings import NodeSettings
from meshnet.presets import canonical_model_name
from meshnet.protocol.control import AuditReport
from meshnet.protocol.ids import NodeId, SessionId
from meshnet.protocol.route import Hop, Route
from meshnet.protocol.signing import decode_public_key, signer_of, verify_request
from meshnet.protocol.tickets import HEADER_TICKET, TicketClaims, VerifiedTickets, check_hop, read_ticket


class TrackerLink(Protocol):
    """What a node's handlers use of its tracker agent (:class:`meshnet.node.agent.TrackerAgent`).

    Attributes:
        endpoint: the URL this node advertises: a relayed node's carries the relay's path (ADR-0045).
        signer: signs the node's calls as the node (its releases as an entry, ADR-0038).
        tunnel: the relay tunnel (:class:`meshnet.relay.tunnel.NodeTunnel`), None when reached directly.
        client: the node's :class:`meshnet.client.TrackerClient`.
    """

    endpoint: str
    signer: httpx.Auth | None
    tunnel: object | None
    client: object

    async def route(self, model: str, layers: LayerRange, exclude: frozenset[NodeId]) -> list[Hop]: ...

    async def session_route(self, model: str, layers: LayerRange, exclude: frozenset[NodeId], session_id: SessionId,
                            like: str | None = None) -> Route: ...

    async def report_failure(self, node_id: NodeId, reason: str) -> None: ...

    async def report_audit(self, node_id: NodeId, report: AuditReport) -> dict: ...


class Caller(Protocol):
    """What these checks read of a node (its :class:`meshnet.node.app.NodeContext`)."""

    settings: NodeSettings
    tracker_key: Ed25519PublicKey | None
    tickets: VerifiedTickets
    agent: TrackerLink | None


class HopCompute(Protocol):
    """What a hop needs of its node's compute (:class:`meshnet.node.runtime.NodeRuntime`): run
    layers for a session in the batcher, and whether the session's entry ended it here."""

    async def forward_async(self, *, model: str | None, session_id: str, layers: LayerRange, position: int,
                            hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[1, seq, hidden]`` through ``layers`` at ``position``; the same shape back."""

    def was_ended(self, session_id: str) -> bool:
        """Whether the entry ended ``session_id`` here (a late step must not re-create it)."""


class HopHost(Caller, Protocol):
    """What hop admission reads besides: the node's compute (for its ended sessions) and its drain."""

    runtime: HopCompute
    drain: Drain


def verify_hop_ticket(node: Caller, token: str | None, session: str, layers: LayerRange,
                      model: str | None) -> TicketClaims | None:
    """The verified claims of a hop's ``token`` when the node has a tracker key (None otherwise).

    Raises:
        Unauthorized (401): the ticket is missing, invalid or expired.
        Forbidden (403 ``ticket_scope``): it does not name this node for exactly ``layers`` of ``session``.
    """
    if node.tracker_key is None:
        return None
    claims = node.tickets.read(token, node.tracker_key)
    check_hop(claims, node_id=node.settings.node_id, session=session, layers=layers,
              model=None if model is None else canonical_model_name(model))
    return claims


def admit_hop(node: HopHost, *, session: str, layers: LayerRange, model: str | None, ticket: str | None,
              position: int) -> TicketClaims | None:
    """The one admission of a hop's work, over HTTP (``POST /v1/forward``) or a stream's OPEN: the
    ticket (:func:`verify_hop_ticket`), and for a call that would start the session (position 0) a
    session its entry already ended here (its release came first) or a draining node refuses it.
    Returns the ticket's claims (None on a node without a tracker key).

    Raises:
        Unauthorized, Forbidden: the ticket is missing, invalid, expired, or does not cover the call.
        SessionConflict: the entry ended this session here.
        Draining: the node takes no new sessions (the entry fails over).
    """
    claims = verify_hop_ticket(node, ticket, session, layers, model)
    if position == 0:
        if node.runtime.was_ended(session):
            raise SessionConflict(f"session {session} was ended by its entry",
                                  hint="a late call of a generation that is over; nothing to do")
        node.drain.refuse_new("new hop sessions")
    return claims


def check_release(node: Caller, request: Request, session: str) -> None:
    """A release, when the node has a tracker key: the session's valid ticket, naming this node, and
    the call signed by the entry node that ticket names (ADR-0038).

    Raises:
        Unauthorized (401): the ticket is missing, invalid or expired, or the call is unsigned, stale
            or not signed by the ticket's entry key.
        Forbidden (403): the ticket is for another session or does not name this node, or the call
            is signed by another node than the ticket's entry.
    """
    if node.tracker_key is None:
        return
    claims = read_ticket(request.headers.get(HEADER_TICKET), node.tracker_key)
    if claims.session != session:
        raise Forbidden(f"the ticket is for session {claims.session}, not {session}", code="ticket_scope")
    if not any(h.node_id == node.settings.node_id for h in claims.hops):
        raise Forbidden(f"the ticket of session {session} does not name {node.settings.node_id}", code="ticket_scope")
    signer = signer_of(request.headers)
    if signer != claims.entry:
        raise Forbidden(f"only the session's entry node {claims.entry} may release it, not {signer}",
                        code="not_your_session")
    verify_signed_call(node, decode_public_key(claims.entry_key), request)


def verify_signed_call(node: Caller, key, request: Request) -> None:
    """Check that a bodiless call is signed with ``key`` (ADR-0035) for the path the caller called:
    this node's own path, or its advertised endpoint's path followed by it (through a relay, the
    relayed endpoint's path comes first).

    Raises:
        Unauthorized (401): unsigned, stale, or not signed with ``key``.
    """
    try:
        verify_request(key, request.headers, request.method, request.url.path, b"")
    except Unauthorized:
        prefix = advertised_path(node)
        if not prefix:
            raise
        verify_request(key, request.headers, request.method, prefix + request.url.path, b"")


def asked_by_tracker(node: Caller, request: Request) -> bool:
    """Whether ``request`` comes from this node's tracker: signed with the tracker's key (ADR-0049),
    or the node has no tracker key (a mesh without tickets: nothing is kept from anyone)."""
    if node.tracker_key is None:
        return True
    try:
        verify_signed_call(node, node.tracker_key, request)
    except (Unauthorized, InvalidRequest):
        return False
    return True


def proxied_by_tracker(scope: Scope) -> bool:
    """Whether a request (an ASGI ``scope`` of the node's app) is a chat this node's tracker proxies:
    signed with the tracker's key (:meth:`meshnet.tracker.tickets.TicketIssuer.sign_call`). The
    tracker counted it against its client already (ADR-0060); without a tracker key, nothing is."""
    node = getattr(scope["app"].state, "node", None)
    if node is None or node.tracker_key is None:
        return False
    try:
        verify_signed_call(node, node.tracker_key, Request(scope))
    except (Unauthorized, InvalidRequest):
        return False
    return True


def advertised_path(node: Caller) -> str:
    """The path part of the endpoint this node advertises ("" for ``http://host:port``): a relayed
    node's ``/v1/relay/{node_id}`` (ADR-0045), or a reverse proxy's prefix given in ``--public-url``."""
    return httpx.URL(advertised_endpoint(node)).path.rstrip("/")


def advertised_endpoint(node: Caller) -> str:
    """The URL this node advertises: its agent's (a relayed node's carries the relay's path,
    ADR-0045), else its own settings' endpoint."""
    endpoint = None if node.agent is None else node.agent.endpoint
    return endpoint or node.settings.endpoint
