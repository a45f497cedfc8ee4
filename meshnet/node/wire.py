"""What a node puts on the wire and takes off it: activation frames to and from torch tensors,
and the node's side of hop streams (ADR-0040), the ``/v1/stream`` endpoint and its hop of every
chain that passes through it.

Frames: :func:`encode` and :func:`decode` are the torch adapter of
:mod:`meshnet.dataplane.frames`, which defines the format (header, dtype codes, zstd rules and
limits; ADR-0001). Big frames are encoded and decoded off the event loop (:func:`encode_async`,
:func:`decode_async`, :func:`decode_soon`).

Streams:
Every message that reaches the node, on a stream a peer opened (:func:`stream_endpoint`) or
on one the node opened itself (:class:`meshnet.dataplane.transport.StreamPool`), goes to
:meth:`ChainHost.dispatch`:

- OPEN: the node checks that the route names it at the message's hop index and, when it knows
  the tracker's key, that the session ticket covers exactly that hop (ADR-0038), before any KV
  cache exists; then it keeps the chain's state and key and starts the chain's worker, which
  first passes the OPEN on to the next hop. A refused OPEN is reported to the entry it names only
  once its ticket's signature verified for the chain: no URL of an unverified OPEN is dialled.
- STEP: queued to the chain's worker when it carries the chain's key (ADR-0049); else dropped. The worker runs a chain's steps one at a time, in order,
  each through :meth:`NodeRuntime.forward` in a worker thread (several chains' steps may run at
  once), and pushes the output to the next hop, or, on the last hop, the RESULT to the entry.
- RESULT, ERROR: for a chain this node drives as entry (:class:`meshnet.dataplane.chain.ChainInbox`).

Any failure becomes one ERROR to the entry naming the hop at fault: this node (its forward
failed, its ticket does not cover the call, it drains) or the next hop (unreachable). A chain's
state goes when its entry releases the session (``DELETE /v1/sessions/{id}``), when its worker
has been idle for the session TTL, or after its first error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.websockets import WebSocket, WebSocketDisconnect

from meshnet.dataplane import frames
from meshnet.node.callers import HopHost, admit_hop
from meshnet.node.metrics import NodeMetrics
from meshnet.dataplane.chain import ChainInbox
from meshnet.dataplane.receipts import TranscriptStep, TranscriptStore, sign_step
from meshnet.dataplane.transport import StreamPool
from meshnet.errors import Forbidden, MeshnetError, TicketExpired, WireError
from meshnet.protocol.route import Hop
from meshnet.dataplane.frames import DEFAULT_MAX_BYTES, MAGIC, MAX_NDIM, MIN_SAVING, READS_BUNDLES, VERSION, ZSTD_MAGIC, \
    ChainError, ChainOpen, Kind, Message, pack, same_key, unbundle, unpack  # noqa: F401 - frame constants re-exported
from meshnet.presets import canonical_model_name

log = logging.getLogger(__name__)

#: torch dtype of each wire dtype name of :data:`meshnet.dataplane.frames.CODES`
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_WIRE_NAMES = {dtype: name for name, dtype in DTYPE_NAMES.items()}


def encode(tensor: torch.Tensor, *, dtype: torch.dtype | str = torch.bfloat16,
           compress: bool = True, level: int = 1) -> bytes:
    """Serialise ``tensor`` into a frame.

    Args:
        tensor: any shape with 1-4 dims (hidden states are ``[batch, seq, hidden]``).
        dtype: wire dtype (bfloat16 default; float32 for exactness checks).
        compress: try zstd (``level``) and keep it when it saves ``MIN_SAVING`` or more.

    Returns:
        The frame bytes.

    Raises:
        WireError: unsupported dtype or rank.
    """
    name = dtype if isinstance(dtype, str) else _WIRE_NAMES.get(dtype)
    if name not in DTYPE_NAMES:
        raise WireError(f"unsupported wire dtype {dtype}")
    header = frames.pack_header(name, tuple(tensor.shape))
    data = tensor.detach().to("cpu", DTYPE_NAMES[name]).contiguous()
    raw = header + data.view(torch.uint8).numpy().tobytes()
    return frames.compress(raw, level) if compress else raw


def decode(body: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, check_finite: bool = True) -> torch.Tensor:
    """Parse a frame back into a tensor (in its wire dtype).

    Raises:
        PayloadTooLarge: body or decompressed body larger than ``max_bytes`` (HTTP 413).
        WireError: bad magic, unknown version or dtype, bad rank, a shape that does not
            match the byte count (:func:`meshnet.dataplane.frames.read_frame`), or non-finite
            values (HTTP 400).
    """
    frame = frames.read_frame(body, max_bytes)
    dtype = DTYPE_NAMES[frame.dtype]
    tensor = torch.frombuffer(bytearray(frame.payload), dtype=dtype).reshape(frame.shape) if len(frame.payload) \
        else torch.empty(frame.shape, dtype=dtype)
    if check_finite and not bool(torch.isfinite(tensor).all()):
        raise WireError("activation contains NaN or infinite values")
    return tensor


#: frames bigger than this (bytes) are encoded and decoded in a worker thread
OFF_LOOP_BYTES = 64 * 1024


async def encode_async(tensor: torch.Tensor, **kw) -> bytes:
    """:func:`encode` for async callers: in a worker thread when the tensor is over
    :data:`OFF_LOOP_BYTES`, so a big frame never blocks the event loop (a one-token decode
    step is encoded inline, where a thread hop would cost more than it saves)."""
    if tensor.numel() * tensor.element_size() > OFF_LOOP_BYTES:
        return await asyncio.to_thread(encode, tensor, **kw)
    return encode(tensor, **kw)


def _off_loop(body: bytes) -> bool:
    """Whether ``body`` is decoded in a worker thread: over :data:`OFF_LOOP_BYTES`, or compressed
    (a small zstd body may expand to ``max_bytes``)."""
    return len(body) > OFF_LOOP_BYTES or body[:4] == ZSTD_MAGIC


async def decode_async(body: bytes, **kw) -> torch.Tensor:
    """:func:`decode` for async callers: in a worker thread when the body is big or compressed."""
    if _off_loop(body):
        return await asyncio.to_thread(decode, body, **kw)
    return decode(body, **kw)


def decode_soon(body: bytes, **kw) -> asyncio.Future:
    """Start decoding ``body`` on the running loop and return the future of its tensor (or of its
    :class:`WireError`). A small frame is decoded at once, its future already done (no task,
    no thread: a one-token decode step); a big or compressed one in a worker thread."""
    loop = asyncio.get_running_loop()
    if _off_loop(body):
        return asyncio.ensure_future(asyncio.to_thread(decode, body, **kw))
    future = loop.create_future()
    try:
        future.set_result(decode(body, **kw))
    except Exception as exc:  # noqa: BLE001 - the awaiting step reports it
        future.set_exception(exc)
    return future



@dataclass
class HopChain:
    """This node's hop of one chain: where it sits, where outputs go, its queued steps."""

    chain_id: str
    key: str                    # the chain key of its OPEN: every STEP must carry it (ADR-0049)
    opened: ChainOpen
    body: bytes                 # the OPEN body, passed on unchanged
    index: int
    hop: Hop
    model: str | None
    expires_at: float | None    # unix seconds when the ticket runs out (None: no ticket needed)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # (STEP, its frame being decoded)
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # (STEP, its output) to encode and send
    worker: asyncio.Task | None = None
    sender: asyncio.Task | None = None
    sending: bool = False       # the sender holds an output it has not sent yet
    #: id of a step's message -> (its tokens, its index in the transcript), until its receipt went
    recorded: dict[int, tuple[int, int]] = field(default_factory=dict)

    @cached_property
    def signed_model(self) -> str:
        """The model name this hop's receipts sign (canonical, ADR-0067), worked out once per chain:
        not on a decode token's path."""
        return canonical_model_name(self.model or "")

    @cached_property
    def next_hop(self) -> Hop | None:
        """The hop this one pushes to (None: the last, which returns to the entry); parsed once
        from the OPEN, not on every step."""
        hops = self.opened.hops
        return Hop.from_json(hops[self.index + 1]) if self.index + 1 < len(hops) else None


class ChainNode(HopHost, Protocol):
    """What a :class:`ChainHost` uses of its node (the node's :class:`meshnet.node.app.NodeContext`):
    besides hop admission's (:class:`meshnet.node.callers.HopHost`: settings, tickets, runtime,
    drain), the metrics a forward is recorded in, the outbound ``streams`` pool, the ``inbox`` of
    the chains it drives as an entry, when it last ran a hop's step, and its transcripts and receipt key
    (ADR-0067)."""

    metrics: NodeMetrics
    streams: StreamPool | None
    inbox: ChainInbox
    last_forward_s: float
    transcripts: TranscriptStore
    step_key: Ed25519PrivateKey | None  # what it signs its step receipts with (None: no identity yet)


class ChainHost:
    """The chains passing through one node (``node``: see :class:`ChainNode`)."""

    def __init__(self, node: ChainNode) -> None:
        self.node = node
        self.chains: dict[str, HopChain] = {}

    def __len__(self) -> int:
        return len(self.chains)

    async def dispatch(self, data: bytes) -> None:
        """Handle one received message (never blocks on compute or on a peer)."""
        try:
            message = unpack(data)
            if message.kind == Kind.BUNDLE:  # several messages sent together: each in order, as if alone
                for inner in unbundle(message):
                    await self.dispatch(inner)
                return
        except MeshnetError as exc:
            log.warning("dropped a stream message: %s", exc.message)
            return
        if message.kind == Kind.OPEN:
            self._open(message)
        elif message.kind == Kind.STEP:
            chain = self.chains.get(message.chain_id)
            if chain is None:  # released, expired, refused, or never opened here: the entry's deadline sees it
                log.debug("step of unknown chain %s at %d dropped", message.chain_id, message.position)
                return
            if not same_key(message, chain.key):  # not from the chain's own hops (ADR-0049)
                log.warning("step of chain %s at %d without the chain's key dropped", message.chain_id,
                            message.position)
                return
            # decoding starts now, so a chunk's frame is decoded while the step before it computes
            chain.queue.put_nowait((message, decode_soon(message.body)))
        elif not self.node.inbox.deliver(message):
            log.debug("%s of unknown chain %s dropped", message.kind.name, message.chain_id)

    def _open(self, message: Message) -> None:
        try:
            opened = ChainOpen.from_body(message.body)
        except MeshnetError as exc:
            log.warning("bad chain OPEN for %s: %s", message.chain_id, exc.message)
            return
        try:
            chain = self._admit(message, opened)
        except MeshnetError as exc:
            if not self._ticket_signed(message, opened):  # dial no URL an unverified OPEN names
                log.warning("refused chain OPEN %s: %s", message.chain_id, exc.message)
                return
            self._report_soon(opened.entry_endpoint, message.chain_id, message.key, message.position,
                              message.hop_index, self.node.settings.node_id, exc)
            return
        self.drop(message.chain_id)
        self.chains[chain.chain_id] = chain
        chain.worker = asyncio.get_running_loop().create_task(self._work(chain))

    def _admit(self, message: Message, opened: ChainOpen) -> HopChain:
        """The chain's state when this node may serve its hop.

        Raises:
            Forbidden: the route does not name this node at the message's hop index.
            Unauthorized, Forbidden, SessionConflict, Draining: the one hop admission (:func:`admit_hop`).
        """
        me = self.node.settings.node_id
        if message.hop_index >= len(opened.hops) or opened.hops[message.hop_index].node_id != me:
            raise Forbidden(f"chain {message.chain_id} does not name {me} as hop {message.hop_index}",
                            code="not_this_hop")
        hop = Hop.from_json(opened.hops[message.hop_index])
        claims = admit_hop(self.node, session=message.chain_id, layers=hop.layers, model=opened.model,
                           ticket=opened.tickets[message.hop_index], position=0)  # an OPEN starts the session
        return HopChain(message.chain_id, message.key, opened, message.body, message.hop_index, hop, opened.model,
                        None if claims is None else claims.expires_at)

    def _ticket_signed(self, message: Message, opened: ChainOpen) -> bool:
        """Whether the OPEN's ticket at its hop index is the tracker's, unexpired and for this chain
        (its scope aside): then the entry it names is the one the tracker routed, and may be told
        why the OPEN was refused. True on a mesh without tickets (nothing to verify)."""
        if self.node.tracker_key is None:
            return True
        if message.hop_index >= len(opened.tickets):
            return False
        try:
            claims = self.node.tickets.read(opened.tickets[message.hop_index], self.node.tracker_key)
        except MeshnetError:
            return False
        return claims.session == message.chain_id

    def drop(self, chain_id: str) -> None:
        """Forget a chain and stop its worker (its KV cache is the runtime's to release)."""
        chain = self.chains.pop(chain_id, None)
        if chain is None:
            return
        for task in (chain.worker, chain.sender):
            if task is not None:
                task.cancel()
        self.node.transcripts.ended(chain_id)
        while not chain.queue.empty():  # frames decoded for nothing: mark their outcome as seen
            _settle(chain.queue.get_nowait()[1])

    async def close(self) -> None:
        for chain_id in list(self.chains):
            self.drop(chain_id)

    # ---- the chain's worker -----------------------------------------------------------

    async def _work(self, chain: HopChain) -> None:
        """Pass the OPEN on, then run the chain's steps in order until it is dropped, idle for the
        session TTL, or a step failed (its ERROR went to the entry). Outputs go to the chain's
        sender, which encodes and sends them in order while the next step computes."""
        node = self.node
        try:
            nxt = chain.next_hop
            if nxt is not None and not await self._push(chain, nxt, pack(
                    Kind.OPEN, chain.chain_id, key=chain.key, hop_index=chain.index + 1, body=chain.body)):
                return
            chain.sender = asyncio.get_running_loop().create_task(self._send_outputs(chain))
            while True:
                try:
                    async with asyncio.timeout(node.settings.session_ttl_s):  # no task per step, unlike wait_for
                        message, decoding = await chain.queue.get()
                except TimeoutError:
                    return
                if not await self._step(chain, message, decoding):
                    return
        finally:
            if self.chains.get(chain.chain_id) is chain:
                del self.chains[chain.chain_id]
            node.transcripts.ended(chain.chain_id)
            chain.outbox.put_nowait(None)  # the sender ends once what is queued has gone

    async def _step(self, chain: HopChain, message: Message, decoding: asyncio.Future) -> bool:
        """Run one STEP and pass its output on: a decode step's at once when nothing is queued ahead of
        it, any other through the sender; False when it failed (the entry was told)."""
        node = self.node
        node.last_forward_s = time.monotonic()
        try:
            hidden = await decoding
        except MeshnetError as exc:  # the frame is the sender's fault: the hop before, or the entry itself
            sender = chain.opened.hops[chain.index - 1].node_id if chain.index > 0 else chain.opened.entry
            exc.message = f"{node.settings.node_id} received an unreadable frame from {sender}: {exc.message}"
            await self._report(chain, message.position, sender, exc)
            return False
        try:
            if chain.expires_at is not None and time.time() >= chain.expires_at:
                raise TicketExpired(f"session ticket of {chain.chain_id} expired",
                                   hint="the entry asks the tracker for a new route and ticket")
            t0 = time.perf_counter()
            out = await node.runtime.forward_async(model=chain.model, session_id=chain.chain_id,
                                                   layers=chain.hop.layers, position=message.position, hidden=hidden,
                                                   rewind=message.rewind)
            node.metrics.record((hidden.shape[1], time.perf_counter() - t0, message.position, time.time(),
                                 time.monotonic()))
        except MeshnetError as exc:
            await self._report(chain, message.position, node.settings.node_id, exc)
            return False
        if chain.opened.receipts:  # the entry audits: keep the step for its questions (ADR-0067)
            step = TranscriptStep(message.position, hidden.shape[1], message.flags, message.body, None)
            chain.recorded[id(message)] = (step.tokens, node.transcripts.record(chain.chain_id, chain.key, step))
        if chain.next_hop is None:
            if message.no_result:
                await self._signed(chain, message, None)
                return True
            if message.last_only:
                out = out[:, -1:]
        if out.shape[1] == 1 and chain.outbox.empty() and not chain.sending:
            # a decode step with nothing ahead of it: sent at once, without a hand-off to the sender
            # (no next step can arrive before its output has gone round the route)
            if not await self._send_output(chain, message, encode(out, dtype=hidden.dtype)):
                self.drop(chain.chain_id)
                return False
            return True
        chain.outbox.put_nowait((message, out, hidden.dtype))
        return True

    async def _send_outputs(self, chain: HopChain) -> None:
        """Encode and send the chain's outputs in order; on a failure the chain ends (the entry was told)."""
        while (item := await chain.outbox.get()) is not None:
            message, out, dtype = item
            chain.sending = True
            try:
                sent = await self._send_output(chain, message, await encode_async(out, dtype=dtype))
            finally:
                chain.sending = False
            if not sent:
                self.drop(chain.chain_id)
                return

    async def _send_output(self, chain: HopChain, message: Message, frame: bytes) -> bool:
        """The RESULT to the entry (last hop) or the STEP to the next hop (then the step's receipt,
        :meth:`_signed`); False when it could not go."""
        node = self.node
        nxt = chain.next_hop
        if nxt is None:
            try:
                await node.streams.send(chain.opened.entry_endpoint, pack(
                    Kind.RESULT, chain.chain_id, key=chain.key, position=message.position, hop_index=chain.index + 1,
                    body=frame))
            except MeshnetError as exc:  # the entry is gone or unreachable: nobody waits for this chain
                log.warning("could not return chain %s's result to its entry: %s", chain.chain_id, exc.message)
                return False
        elif not await self._push(chain, nxt, pack(Kind.STEP, chain.chain_id, key=chain.key, position=message.position,
                                                   hop_index=chain.index + 1, flags=message.flags, body=frame)):
            return False
        await self._signed(chain, message, frame)
        return True

    async def _signed(self, chain: HopChain, message: Message, frame: bytes | None) -> None:
        """When the entry asked for receipts: keep the step's output in this node's transcript (the
        step is there since it ran) and send the entry the step's signed receipt (ADR-0067; best
        effort: a lost receipt is the entry's to notice). ``frame``: the output sent (None: nothing was)."""
        node = self.node
        tokens, index = chain.recorded.pop(id(message), (0, None))
        if index is None:
            return
        if frame is not None:
            node.transcripts.set_output(chain.chain_id, index, frame)
        key = node.step_key
        if key is None:
            return
        receipt = sign_step(key, chain.signed_model, chain.chain_id, chain.hop.layers, message.position, tokens,
                            message.flags, message.body, frame)
        try:
            await node.streams.send(chain.opened.entry_endpoint, pack(
                Kind.RECEIPT, chain.chain_id, key=chain.key, position=message.position,
                hop_index=min(chain.index + 1, 255), flags=message.flags, body=receipt.to_bytes()))
        except MeshnetError as exc:
            log.debug("could not send chain %s's receipt to its entry: %s", chain.chain_id, exc.message)

    async def _push(self, chain: HopChain, nxt: Hop, data: bytes) -> bool:
        """Send ``data`` to the next hop; when it cannot be reached tell the entry, naming it."""
        try:
            await self.node.streams.send(nxt.endpoint, data)
            return True
        except MeshnetError as exc:
            exc.message = f"{self.node.settings.node_id} could not reach its next hop: {exc.message}"
            await self._report(chain, 0, nxt.node_id, exc)
            return False

    async def _report(self, chain: HopChain, position: int, node_id: str, exc: MeshnetError) -> None:
        """Tell the entry of ``chain`` that its step at ``position`` failed at ``node_id``."""
        await self._tell_entry(chain.opened.entry_endpoint, chain.chain_id, chain.key, position, chain.index,
                               node_id, exc)

    async def _tell_entry(self, entry_endpoint: str, chain_id: str, key: str, position: int, index: int,
                          node_id: str, exc: MeshnetError) -> None:
        """Send the entry one ERROR naming ``node_id``, from this node as hop ``index`` of the chain
        with key ``key`` (best effort: the entry's deadline covers a loss). The header carries
        ``index + 1``, so an entry that cannot read the body still knows which hop sent it."""
        body = ChainError(node_id=node_id, code=exc.code, message=exc.message, status=exc.status).to_body()
        try:
            await self.node.streams.send(entry_endpoint, pack(Kind.ERROR, chain_id, key=key, position=position,
                                                              hop_index=min(index + 1, 255), body=body))
        except MeshnetError as send_exc:
            log.warning("could not tell the entry of chain %s about %s: %s", chain_id, exc.message, send_exc.message)

    def _report_soon(self, entry_endpoint: str, chain_id: str, key: str, position: int, index: int, node_id: str,
                     exc: MeshnetError) -> None:
        task = asyncio.get_running_loop().create_task(self._tell_entry(entry_endpoint, chain_id, key, position, index,
                                                                       node_id, exc))
        _background.add(task)
        task.add_done_callback(_background.discard)


_background: set[asyncio.Task] = set()


def _settle(future: asyncio.Future) -> None:
    """Cancel a pending decode, or mark a finished one's outcome (an error included) as seen."""
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


async def stream_endpoint(websocket: WebSocket) -> None:
    """``/v1/stream``: accept a peer's hop stream and dispatch every binary message it sends. The
    :data:`~meshnet.dataplane.frames.READS_BUNDLES` subprotocol is accepted when the peer offers it."""
    node = websocket.app.state.node
    offered = websocket.scope.get("subprotocols", ())
    await websocket.accept(subprotocol=READS_BUNDLES if READS_BUNDLES in offered else None)
    try:
        while True:
            data = await websocket.receive_bytes()
            counts = node.metrics.served_streams["in"]
            counts[0] += 1
            counts[1] += len(data)
            await node.chains.dispatch(data)
    except (WebSocketDisconnect, RuntimeError, KeyError):
        return  # the peer closed, or sent text (receive_bytes refuses it): the stream ends
