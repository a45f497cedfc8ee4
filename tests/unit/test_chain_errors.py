"""An ERROR message fails a chain and names the hop at fault (meshnet.dataplane.chain, ADR-0040),
even when its body cannot be read: the sender's place in the chain travels in the header."""

from __future__ import annotations

import httpx

from meshnet.errors import HopBusy, HopFailed
from meshnet.dataplane.chain import ChainEnd, ChainInbox, ChainRoute
from meshnet.dataplane.failover import MeshLink, RemoteContext
from meshnet.layers import LayerRange
from meshnet.protocol.route import Hop, Route
from meshnet.dataplane.frames import ChainError, Kind, new_chain_id, pack, unpack

HOPS = [Hop("node-a", "http://127.0.0.1:9001", LayerRange(10, 20)),
        Hop("node-b", "http://127.0.0.1:9002", LayerRange(20, 30))]


def chain_route() -> ChainRoute:
    async def no_route(*_args, **_kwargs):
        raise AssertionError("no new route is asked for here")

    async def no_report(*_args, **_kwargs):
        return None

    ctx = RemoteContext(MeshLink(httpx.AsyncClient(), no_route, no_report), "tiny", codec=None)
    return ChainRoute(ctx, ChainEnd("entry", "http://127.0.0.1:9000", None, ChainInbox()), route=Route(list(HOPS)),
                      layers=LayerRange(10, 30), chain_id=new_chain_id())


async def test_an_unreadable_error_blames_the_hop_that_sent_it():
    chain = chain_route()
    chain.deliver(unpack(pack(Kind.ERROR, chain.chain_id, key=chain.key, hop_index=2, body=b"\x00not json")))
    failure = chain.broken.result()
    assert type(failure) is HopFailed
    assert failure.node_id == "node-b"
    assert failure.message.startswith("hop node-b at http://127.0.0.1:9002 (layers 20-29) sent an unreadable "
                                      "error: bad chain ERROR")


async def test_an_unreadable_error_without_its_sender_blames_nobody():
    for index in (0, 3):  # not given; beyond the chain
        chain = chain_route()
        chain.deliver(unpack(pack(Kind.ERROR, chain.chain_id, key=chain.key, hop_index=index, body=b"{}")))
        failure = chain.broken.result()
        assert failure.node_id is None
        assert failure.message.startswith("the chain sent an unreadable error: bad chain ERROR")


async def test_a_readable_error_names_the_hop_in_its_body_not_its_sender():
    chain = chain_route()
    body = ChainError(node_id="node-b", code="hop_unreachable", message="node-a could not reach its next hop",
                      status=502).to_body()
    chain.deliver(unpack(pack(Kind.ERROR, chain.chain_id, key=chain.key, hop_index=1, body=body)))
    failure = chain.broken.result()
    assert failure.node_id == "node-b" and failure.code == "hop_failed"
    busy = chain_route()
    body = ChainError(node_id="node-a", code="node_busy", message="full", status=503).to_body()
    busy.deliver(unpack(pack(Kind.ERROR, busy.chain_id, key=busy.key, hop_index=1, body=body)))
    assert type(busy.broken.result()) is HopBusy and busy.broken.result().node_id == "node-a"
