"""Signed step receipts and hop transcripts: what a hop computed, said so that it cannot deny it (ADR-0067).

For every step of a chain a hop runs, it signs a receipt with its node key (Ed25519,
:mod:`meshnet.node.identity`) and sends it to the chain's entry (a RECEIPT message,
:mod:`meshnet.dataplane.frames`). The signed message binds::

    b"meshnet-receipt/3" | SHA-256 of the model's canonical name | chain id (16 raw bytes)
    | first layer, end layer (uint32 LE each, half-open) | position (uint32 LE) | tokens (uint32 LE)
    | flags (1 byte) | SHA-256 of the input frame | SHA-256 of the output frame

(the output digest is 32 zero bytes for a step that returned nothing, a failover's replay chunk
on the last hop). The chain id names the session in the hop's ticket, which names the model and
the node, so a receipt says: "for this input at these positions of this session, through these
layers, I sent this output". The layers are signed too: an entry may hold more than one ticket
for a session (a failover re-routes it) and a node may serve a sub-range of its shard, so without
them a report could claim other layers than the ones run and frame an honest node with its own
signature. The model is signed for the same reason: a node serving one layer range of two models
could otherwise have its honest steps of one judged as steps of the other (callers pass the
canonical name, :func:`meshnet.presets.canonical_model_name`, so an alias signs the same bytes). A
RECEIPT body is the two digests and the signature, 128 bytes.

Each hop also keeps its own transcript (:class:`TranscriptStore`): the frames it received and
sent, by chain, for a while after the session ends, bounded in bytes. An audit
(:mod:`meshnet.gateway.audit`) asks for it with the chain's key and checks it against the
receipts: a transcript that differs from what the hop signed is no transcript of that session.

Torch-free: nodes sign and keep, entries collect and compare, the tracker verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshnet.dataplane.frames import FLAG_REWIND, read_frame
from meshnet.errors import MeshnetError, WireError
from meshnet.layers import LayerRange
from meshnet.protocol.signing import b64url, unb64url

__all__ = ["HEADER_CHAIN_KEY", "HEADER_RECEIPT", "NO_OUTPUT", "RECEIPT_BYTES", "Receipt", "TranscriptStep",
           "TranscriptStore", "digest", "history_problem", "read_transcript", "rebuild_transcript", "receipt_message",
           "replay_runs", "sign_step", "transcript_json", "verify_step"]

_CONTEXT = b"meshnet-receipt/3"
#: a RECEIPT body: input digest, output digest, signature
RECEIPT_BYTES = 32 + 32 + 64
#: the output digest of a step that returned nothing
NO_OUTPUT = bytes(32)


def digest(frame: bytes | None) -> bytes:
    """SHA-256 of a frame's bytes as they travelled (:data:`NO_OUTPUT` for None)."""
    return NO_OUTPUT if frame is None else hashlib.sha256(frame).digest()


def receipt_message(model: str, chain_id: str, layers: LayerRange, position: int, tokens: int, flags: int,
                    in_digest: bytes, out_digest: bytes) -> bytes:
    """The bytes a receipt's signature covers (see the module doc).

    Raises:
        ValueError: ``chain_id`` is not 32 hex characters, or a digest is not 32 bytes.
    """
    if len(in_digest) != 32 or len(out_digest) != 32:
        raise ValueError("receipt digests are 32 bytes each")
    return (_CONTEXT + hashlib.sha256(model.encode()).digest() + uuid.UUID(hex=chain_id).bytes
            + struct.pack("<IIIIB", layers.start, layers.end, position, tokens, flags & 0xFF) + in_digest + out_digest)


@dataclass(frozen=True)
class Receipt:
    """One step's receipt: ``in_digest`` and ``out_digest`` (32 bytes each) and the hop's Ed25519
    ``signature`` (64 bytes) over :func:`receipt_message`."""

    in_digest: bytes
    out_digest: bytes
    signature: bytes

    def to_bytes(self) -> bytes:
        """The 128-byte RECEIPT body."""
        return self.in_digest + self.out_digest + self.signature

    @classmethod
    def from_bytes(cls, body: bytes) -> "Receipt":
        """Parse a RECEIPT body.

        Raises:
            WireError: not :data:`RECEIPT_BYTES` long.
        """
        if len(body) != RECEIPT_BYTES:
            raise WireError(f"a receipt is {RECEIPT_BYTES} bytes, got {len(body)}")
        return cls(bytes(body[:32]), bytes(body[32:64]), bytes(body[64:]))


def sign_step(key: Ed25519PrivateKey, model: str, chain_id: str, layers: LayerRange, position: int, tokens: int,
              flags: int, frame_in: bytes, frame_out: bytes | None) -> Receipt:
    """The receipt of one step: ``frame_in`` (``tokens`` positions from ``position``) run through
    ``layers`` of ``model`` (its canonical name) gave ``frame_out`` (None: nothing was sent back)."""
    ins, outs = digest(frame_in), digest(frame_out)
    return Receipt(ins, outs, key.sign(receipt_message(model, chain_id, layers, position, tokens, flags, ins, outs)))


def verify_step(public_key: Ed25519PublicKey, model: str, chain_id: str, layers: LayerRange, position: int,
                tokens: int, flags: int, frame_in: bytes, frame_out: bytes | None, receipt: Receipt) -> str:
    """Why ``receipt`` does not show that the key's node turned ``frame_in`` into ``frame_out``
    through ``layers`` of ``model`` (its canonical name; "" when it does)."""
    if digest(frame_in) != receipt.in_digest:
        return f"the input at position {position} is not the one the receipt names"
    if digest(frame_out) != receipt.out_digest:
        return f"the output at position {position} is not the one the receipt names"
    try:
        public_key.verify(receipt.signature, receipt_message(model, chain_id, layers, position, tokens, flags,
                                                             receipt.in_digest, receipt.out_digest))
    except (InvalidSignature, ValueError):
        return f"the receipt at position {position} is not signed by the node"
    return ""


@dataclass(frozen=True)
class TranscriptStep:
    """One step a hop ran: ``tokens`` positions from ``position``, the message ``flags``, the frame
    it received and the one it sent (None: it sent nothing)."""

    position: int
    tokens: int
    flags: int
    frame_in: bytes
    frame_out: bytes | None

    @property
    def size(self) -> int:
        return len(self.frame_in) + len(self.frame_out or b"")


class TranscriptStore:
    """A hop's transcripts, by chain id: every step in the order the hop ran it (a speculative
    step that rewound the session included, after the steps it took back), kept while the chain
    lives and ``keep_s`` seconds after it ended, at most ``max_bytes`` of frames in all (the
    oldest chain's go first).

    Defaults: 64 MiB (the transcripts of about 200 sessions of 256 tokens of a 576-wide model, in
    and out) and 120 s (an audit asks at once after its session ends, ADR-0067).
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024, keep_s: float = 120.0) -> None:
        self.max_bytes, self.keep_s = max_bytes, keep_s
        self._chains: OrderedDict[str, list[TranscriptStep]] = OrderedDict()
        self._keys: dict[str, str] = {}  # chain id -> its chain key (only its holders may read it)
        self._ended: dict[str, float] = {}  # chain id -> monotonic time it ended
        self._bytes = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def record(self, chain_id: str, key: str, step: TranscriptStep) -> int:
        """Keep ``step`` of ``chain_id`` (whose chain key is ``key``) after those kept; its index,
        for :meth:`set_output`."""
        steps = self._chains.get(chain_id)
        if steps is None:
            steps = self._chains[chain_id] = []
            self._keys[chain_id] = key
        steps.append(step)
        self._bytes += step.size
        self._evict()
        return len(steps) - 1

    def set_output(self, chain_id: str, index: int, frame_out: bytes) -> None:
        """The output the step at ``index`` of ``chain_id`` sent (nothing when the chain's transcript
        is gone meanwhile)."""
        steps = self._chains.get(chain_id)
        if steps is None or index >= len(steps):
            return
        old = steps[index]
        steps[index] = replace(old, frame_out=frame_out)
        self._bytes += len(frame_out) - len(old.frame_out or b"")
        self._evict()

    def ended(self, chain_id: str) -> None:
        """The chain ended here (released, expired, dropped): its transcript goes after ``keep_s``."""
        if chain_id in self._chains:
            self._ended.setdefault(chain_id, time.monotonic())
        self._evict()

    def steps(self, chain_id: str, key: str) -> list[TranscriptStep] | None:
        """The chain's steps in the order the hop ran them, or None when none are kept or ``key`` is
        not the chain's key (compared in constant time)."""
        self._evict()
        steps = self._chains.get(chain_id)
        if steps is None or not hmac.compare_digest(self._keys.get(chain_id, ""), key):
            return None
        return list(steps)

    def _evict(self) -> None:
        now = time.monotonic()
        for chain_id in [c for c, at in self._ended.items() if now - at > self.keep_s]:
            self._drop(chain_id)
        while self._bytes > self.max_bytes and self._chains:
            self._drop(next(iter(self._chains)))

    def _drop(self, chain_id: str) -> None:
        steps = self._chains.pop(chain_id, [])
        self._bytes -= sum(s.size for s in steps)
        self._ended.pop(chain_id, None)
        self._keys.pop(chain_id, None)


#: the header a transcript request carries the chain's key in (``GET /v1/transcripts/{chain id}``)
HEADER_CHAIN_KEY = "X-Meshnet-Chain-Key"
#: the header of a hop call's answer (``POST /v1/forward``) that carries its receipt (base64url)
HEADER_RECEIPT = "X-Meshnet-Receipt"


def transcript_json(chain_id: str, node_id: str, steps: list[TranscriptStep]) -> dict:
    """The JSON form of a hop's transcript (frames as base64url): what ``GET /v1/transcripts/{id}``
    returns and :func:`read_transcript` reads."""
    return {"chain_id": chain_id, "node_id": node_id,
            "steps": [{"position": s.position, "tokens": s.tokens, "flags": s.flags, "input": b64url(s.frame_in),
                       "output": None if s.frame_out is None else b64url(s.frame_out)} for s in steps]}


def history_problem(steps: list[TranscriptStep]) -> str:
    """Why ``steps`` (in the order a hop ran them) are not one session's history ("" when they are):
    the first at position 0, each ordinary step where the one before it ended, a speculative step
    (:data:`meshnet.dataplane.frames.FLAG_REWIND`) at or before that."""
    expected = 0
    for s in steps:
        rewind = bool(s.flags & FLAG_REWIND)
        if s.position > expected or (s.position < expected and not rewind):
            return f"a step at position {s.position} where position {expected} was next"
        expected = s.position + s.tokens
    return "" if steps else "no steps"


def rebuild_transcript(receipts: list[tuple[int, int, Receipt]], inputs: list[bytes],
                       outputs: list[bytes]) -> list[TranscriptStep] | None:
    """A hop's transcript rebuilt without it, from what its neighbours kept: its ``receipts``
    (``(position, flags, receipt)`` in the order it sent them) name the digest of every frame it
    took and sent; ``inputs`` are the frames sent to it (the entry's own, or the hop before it's
    transcript outputs), ``outputs`` the frames it sent on (the hop after it's transcript inputs, or
    the results the entry received). A hop that withholds its transcript is audited anyway
    (ADR-0067, amended 2026-12-07): its receipts bind it to these frames.

    Returns:
        The steps in order, or None when a frame a receipt names is missing from the pools or the
        steps are no session's history (:func:`history_problem`).
    """
    by_in = {digest(frame): frame for frame in inputs}
    by_out = {digest(frame): frame for frame in outputs}
    steps = []
    for position, flags, receipt in receipts:
        frame_in = by_in.get(receipt.in_digest)
        frame_out = None if receipt.out_digest == NO_OUTPUT else by_out.get(receipt.out_digest)
        if frame_in is None or (frame_out is None and receipt.out_digest != NO_OUTPUT):
            return None
        try:
            shape = read_frame(frame_in).shape
        except MeshnetError:
            return None
        if len(shape) != 3:
            return None
        steps.append(TranscriptStep(position, shape[1], flags, frame_in, frame_out))
    return steps if not history_problem(steps) else None


def replay_runs(steps: list[TranscriptStep]) -> list[list[TranscriptStep]]:
    """``steps`` cut into the runs an audit replays together: each speculative step
    (:data:`FLAG_REWIND`) alone, the ordinary steps between them as one run (contiguous: replayed
    as a chunked prefill). A replay's own calls cut by the same rule give one group per run of
    the steps it replayed (ADR-0067)."""
    runs: list[list[TranscriptStep]] = []
    for s in steps:
        if s.flags & FLAG_REWIND or not runs or runs[-1][0].flags & FLAG_REWIND:
            runs.append([s])
        else:
            runs[-1].append(s)
    return runs


def read_transcript(data: dict) -> list[TranscriptStep]:
    """The steps of a :func:`transcript_json` document.

    Raises:
        WireError: a step is missing a field or a frame is not base64url.
    """
    try:
        return [TranscriptStep(int(s["position"]), int(s["tokens"]), int(s["flags"]), unb64url(s["input"]),
                               None if s.get("output") is None else unb64url(s["output"])) for s in data["steps"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"unreadable transcript: {type(exc).__name__}: {exc}") from None
