"""Audits: an entry re-runs a share of its chains' hops, every position, prefill and decode alike (ADR-0067).

Every hop of a chain signs a receipt of each step it runs and sends it to the entry
(:mod:`meshnet.dataplane.receipts`), and keeps its transcript for a while after the session.
When a session the entry drew for an audit ends, for each remote hop the entry:

1. asks the hop for its transcript (``GET /v1/transcripts/{chain}`` with the chain's key) and
   checks it against the receipts the hop sent during the session: the frames must be the ones it
   signed, and its inputs the ones the hop before it (or the entry) signed as sent;
2. replays the transcript's inputs as a chunked prefill (:func:`meshnet.dataplane.replay.rechunk`)
   on another holder of the hop's layers and recipe, under a fresh session, every position
   returned, and measures every step's output against it
   (:func:`meshnet.dataplane.evidence.step_distances`);
3. when a step is further than the recipe's tolerance, sends the tracker the hop's signed steps up
   to the worst one (``POST /v1/nodes/{id}/audit``) with the witness's own signed calls (its
   receipts of the replay): the tracker re-runs the steps on holders it picks and decides
   (:mod:`meshnet.tracker.audit`); when its holders agree with the hop, the witness's signed replay
   shows whether the witness lied to this entry (it is then the one quarantined) or the entry
   made the dispute up.

With the hops' keys (``keys``), the entry first checks every receipt it would send, the hop's and
the witness's: a node that signs garbage would otherwise make the entry's evidence look forged,
and a witness that signs nothing would leave the entry's word against the tracker's re-run.
Such an audit is counted (``unsigned``) and disputes nothing.

The hop cannot tell an audited session from another: every session's hops sign and keep the
same things, and the question comes only after the session ended, when its receipts already
bind it. A hop that no longer has the transcript, or whose transcript is not what it signed,
is counted (``withheld``) and logged: that alone is no proof (a restart loses transcripts). It is
audited anyway where its neighbours kept the frames its receipts name (``rebuilt``): the entry
keeps the frames it sent and the results it received, and the hops before and after it keep
theirs (:func:`meshnet.dataplane.receipts.rebuild_transcript`), so withholding hides nothing unless
a neighbour withholds too.

How often: each session is audited with probability ``rate``; a session through a hop that has
passed fewer than ``probation_passes`` audits here with ``probation_rate`` (new holders are
audited often until they have shown something).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx

from meshnet.dataplane.chain import ChainRecord, ChainRoute
from meshnet.dataplane.codec import ActivationCodec
from meshnet.dataplane.evidence import audit_tolerance, reference_rows, step_distances
from meshnet.dataplane.hops import RemoteRoute, post_forward
from meshnet.dataplane.frames import FLAG_REWIND
from meshnet.dataplane.receipts import HEADER_CHAIN_KEY, Receipt, TranscriptStep, digest, history_problem, \
    read_transcript, rebuild_transcript, replay_runs, verify_step
from meshnet.dataplane.replay import rechunk
from meshnet.errors import MeshnetError
from meshnet.gateway.spotcheck import WitnessRoutes, witness_session
from meshnet.layers import LayerRange
from meshnet.protocol.control import AuditReplay, AuditReport, AuditStep
from meshnet.protocol.route import Hop
from meshnet.protocol.signing import b64url, decode_public_key, unb64url
from meshnet.presets import canonical_model_name

log = logging.getLogger(__name__)

__all__ = ["AuditStats", "Auditor", "AuditReporter", "DEFAULT_AUDIT_RATE", "KeyLookup", "PROBATION_PASSES",
           "PROBATION_RATE"]

#: async (node id, report) -> the tracker's answer (``POST /v1/nodes/{id}/audit``)
AuditReporter = Callable[[str, AuditReport], Awaitable[dict]]
#: async node id -> its public key (base64url Ed25519, ``GET /v1/nodes/{id}/key``), None when unknown
KeyLookup = Callable[[str], Awaitable[str | None]]
#: the share of sessions audited through proven hops. A hop lying on every request it serves is
#: then caught within 50 of them with probability 1 - 0.94**50 = 95.5 % (issue target: 19 of 20)
DEFAULT_AUDIT_RATE = 0.06
#: the share of sessions audited while one of their hops is on probation
PROBATION_RATE = 0.5
#: audits a hop passes here before it leaves probation
PROBATION_PASSES = 5
#: seconds an audit waits after its session ended for the hops' last receipts
RECEIPT_WAIT_S = 0.5


@dataclass
class AuditStats:
    """What this entry's audits found (metrics and benches read them)."""

    audits: int = 0       # hops audited
    passed: int = 0
    disputes: int = 0     # reported to the tracker
    withheld: int = 0     # no transcript, or not the one the hop signed
    rebuilt: int = 0      # of those, audited on a transcript rebuilt from its neighbours' frames
    unverified: int = 0   # no witness
    mismatched: int = 0   # a hop's signed input is not what the hop before it signed as sent
    unsigned: int = 0     # a receipt, the hop's or the witness's, does not verify with its node's key
    #: the latest verdicts the tracker gave, newest last (at most 100)
    verdicts: list[dict] = field(default_factory=list)
    #: the largest step distance of each of the latest audits (at most 100)
    distances: list[float] = field(default_factory=list)


class Auditor:
    """Draws the sessions to audit and audits them after they end.

    Args:
        rate: probability that a session through proven hops is audited (0 disables audits).
        client: httpx client for transcripts and witness calls; ``timeout_s`` bounds each.
        routes: finds witnesses (as spot-checks do: holders of the hop's layers and recipe).
        report: sends a dispute to the tracker (:data:`AuditReporter`).
        limit: the step distance above which a hop is disputed (default: the bfloat16 audit tolerance,
            :data:`meshnet.dataplane.evidence.AUDIT_TOLERANCE`; the tracker applies the hop's recipe's own).
        chunk_tokens: positions per replayed chunk on the witness.
        probation_rate, probation_passes: see the module doc.
        release_auth: signs the witnesses' session releases as this entry.
        keys: looks up a node's public key (:data:`KeyLookup`), to check receipts before they go
            to the tracker as evidence (None: not checked here).
        rng: the source of the draws (tests pass a seeded one).
    """

    def __init__(self, rate: float = DEFAULT_AUDIT_RATE, *, client: httpx.AsyncClient, routes: WitnessRoutes,
                 report: AuditReporter, limit: float | None = None, timeout_s: float = 60.0, chunk_tokens: int = 128,
                 probation_rate: float = PROBATION_RATE, probation_passes: int = PROBATION_PASSES,
                 release_auth: httpx.Auth | None = None, keys: KeyLookup | None = None,
                 rng: random.Random | None = None) -> None:
        for name, value in (("audit rate", rate), ("probation rate", probation_rate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within 0..1, got {value}")
        self.rate, self.client, self.routes, self.report = rate, client, routes, report
        self.limit = audit_tolerance("bfloat16") if limit is None else limit
        self.timeout_s, self.chunk_tokens = timeout_s, chunk_tokens
        self.probation_rate, self.probation_passes = probation_rate, probation_passes
        self.release_auth, self.keys = release_auth, keys
        self.rng = rng or random.Random()
        self.stats = AuditStats()
        self.passes: dict[str, int] = {}  # node id -> audits it passed here
        self._tasks: set[asyncio.Task] = set()

    def draw(self, hops: list[Hop]) -> bool:
        """Whether to audit a session through ``hops`` (0 rate: never)."""
        if self.rate <= 0:
            return False
        probation = any(self.passes.get(h.node_id, 0) < self.probation_passes for h in hops)
        return self.rng.random() < (max(self.rate, self.probation_rate) if probation else self.rate)

    def audit_soon(self, chain: "ChainRoute | RemoteRoute", codec: ActivationCodec) -> None:
        """Audit ``chain``'s hops in the background once its session has ended (closed with
        ``linger``): after :data:`RECEIPT_WAIT_S`, so that the receipts of its last steps are in.
        A session on the HTTP hop path (:class:`meshnet.dataplane.hops.RemoteRoute`, recording)
        is audited the same way on the steps this entry recorded."""
        async def later() -> None:
            try:
                await asyncio.sleep(RECEIPT_WAIT_S)
            finally:
                chain.forget()
            await self.audit(chain.audit_record(), codec)

        task = asyncio.get_running_loop().create_task(later())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Until the audits under way have finished (tests and benches)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def audit(self, record: ChainRecord, codec: ActivationCodec) -> list[dict | None]:
        """Audit every remote hop of ``record``; per hop, the tracker's verdict when a dispute went
        to it, else None. Never raises (a failed audit is logged)."""
        if not record.sent:  # nothing was sent down it
            return []
        out = []
        transcripts = list(record.transcripts) if record.transcripts is not None else \
            [await self._transcript(record, hop) for hop in record.hops]  # a chain's: each hop keeps its own
        for index, hop in enumerate(record.hops):
            try:
                out.append(await self._audit_hop(record, index, hop, codec, transcripts))
            except Exception:  # noqa: BLE001 - an audit must never hurt the entry
                log.warning("audit of %s on chain %s failed", hop.node_id, record.chain_id, exc_info=True)
                out.append(None)
        return out

    @staticmethod
    def _hop_receipts(record: ChainRecord, index: int) -> list[tuple[int, int, Receipt]]:
        """Hop ``index``'s readable receipts as ``(position, flags, receipt)``, in the order it sent them."""
        out = []
        for i, position, flags, body in record.receipts:
            if i == index:
                try:
                    out.append((position, flags, Receipt.from_bytes(body)))
                except MeshnetError:
                    continue
        return out

    @classmethod
    def _receipts(cls, record: ChainRecord, index: int) -> dict[tuple[int, bytes, int], Receipt]:
        """Hop ``index``'s receipts by (position, input digest, flags): what it signed it was given."""
        return {(position, r.in_digest, flags): r for position, flags, r in cls._hop_receipts(record, index)}

    async def _transcript(self, record: ChainRecord, hop: Hop) -> list[TranscriptStep] | None:
        try:
            resp = await self.client.get(f"{hop.endpoint}/v1/transcripts/{record.chain_id}",
                                         headers={HEADER_CHAIN_KEY: record.key}, timeout=self.timeout_s)
            if resp.status_code != 200:
                return None
            return read_transcript(resp.json())
        except (httpx.HTTPError, ValueError, MeshnetError):
            return None

    def _signed_transcript(self, record: ChainRecord, index: int,
                           transcripts: list[list[TranscriptStep] | None]) -> list[TranscriptStep] | None:
        """Hop ``index``'s transcript when it is the one the hop signed, else None."""
        steps = transcripts[index]
        return steps if steps is not None and not _unsigned(steps, self._receipts(record, index)) else None

    def _rebuilt(self, record: ChainRecord, index: int,
                 transcripts: list[list[TranscriptStep] | None]) -> list[TranscriptStep] | None:
        """Hop ``index``'s transcript rebuilt from its receipts and its neighbours' frames
        (:func:`rebuild_transcript`): the entry's own frames for the first hop's inputs and the
        results it received for the last hop's outputs, the adjacent hops' signed transcripts
        otherwise. None when a neighbour's is missing too, or a frame a receipt names."""
        last = len(record.hops) - 1
        before = None if index == 0 else self._signed_transcript(record, index - 1, transcripts)
        after = None if index == last else self._signed_transcript(record, index + 1, transcripts)
        if (index and before is None) or (index < last and after is None):
            return None
        inputs = list(record.sent_frames) if index == 0 else [s.frame_out for s in before if s.frame_out is not None]
        outputs = list(record.results) if index == last else [s.frame_in for s in after]
        return rebuild_transcript(self._hop_receipts(record, index), inputs, outputs)

    async def _audit_hop(self, record: ChainRecord, index: int, hop: Hop, codec: ActivationCodec,
                         transcripts: list[list[TranscriptStep] | None]) -> dict | None:
        self.stats.audits += 1
        steps = transcripts[index]
        receipts = self._receipts(record, index)
        why = _unsigned(steps, receipts)
        if why:
            self.stats.withheld += 1
            steps = self._rebuilt(record, index, transcripts)
            if steps is None:
                log.warning("audit of %s on chain %s: %s", hop.node_id, record.chain_id, why)
                return None
            self.stats.rebuilt += 1
            log.warning("audit of %s on chain %s: %s; audited on the frames its receipts name, which its "
                        "neighbours kept", hop.node_id, record.chain_id, why)
        sent = self._sent_to(record, index)
        wrong = [s.position for s in steps if (s.position, digest(s.frame_in)) not in sent]
        if wrong:
            self.stats.mismatched += 1
            log.warning("audit of %s on chain %s: its signed inputs at positions %s are not what was sent to it",
                        hop.node_id, record.chain_id, wrong[:5])
            return None
        witnessed = await self._witness_run(record, hop, steps, codec)
        if witnessed is None:
            self.stats.unverified += 1
            return None
        distances, replay = witnessed
        worst = max(range(len(distances)), key=distances.__getitem__)
        self.stats.distances = (self.stats.distances + [distances[worst]])[-100:]
        if distances[worst] <= self.limit:
            self.stats.passed += 1
            self.passes[hop.node_id] = self.passes.get(hop.node_id, 0) + 1
            return None
        log.warning("audit: %s's output at position %d of chain %s is %.4f from a second holder's (> %.4f); "
                    "asking the tracker", hop.node_id, steps[worst].position, record.chain_id, distances[worst],
                    self.limit)
        disputed = steps[:worst + 1]
        signed = [receipts[(s.position, digest(s.frame_in), s.flags)] for s in disputed]
        replay = replay.upto(disputed) if replay is not None else None
        model = canonical_model_name(record.model or "")
        why = await self._unverified(hop.node_id, model, record.chain_id, hop.layers, disputed, signed)
        if not why and replay is not None:
            why = await self._unverified(replay.witness, model, replay.session, hop.layers, replay.steps,
                                         replay.receipts)
        elif not why and self.keys is not None:  # a witness that signs nothing leaves the entry's word alone
            why = "the witness sent no signed receipt of its replay"
        if why:
            self.stats.unsigned += 1
            log.warning("audit of %s on chain %s: no dispute, the evidence would not stand: %s", hop.node_id,
                        record.chain_id, why)
            return None
        self.stats.disputes += 1
        start, end = hop.layers.to_inclusive()
        ticket = record.hop_tickets[index] if record.hop_tickets else record.ticket
        report = AuditReport(model=record.model or "", shard_start=start, shard_end=end, chain_id=record.chain_id,
                             ticket=ticket or "", steps=_audit_steps(disputed, signed),
                             replay=None if replay is None else AuditReplay(
                                 witness=replay.witness, session=replay.session,
                                 steps=_audit_steps(replay.steps, replay.receipts)))
        try:
            verdict = await self.report(hop.node_id, report)
        except Exception as exc:  # noqa: BLE001 - a lost report must not fail anything else
            log.warning("could not report the audit of %s: %s", hop.node_id, exc)
            return None
        self.stats.verdicts = (self.stats.verdicts + [verdict])[-100:]
        return verdict

    async def _unverified(self, node_id: str, model: str, chain_id: str, layers: LayerRange,
                          steps: list[TranscriptStep], receipts: list[Receipt]) -> str:
        """Why ``receipts`` do not show that ``node_id`` ran ``steps`` of ``chain_id`` through
        ``layers`` of ``model`` ("" when they do, or when this auditor has no :data:`KeyLookup`)."""
        if self.keys is None:
            return ""
        try:
            text = await self.keys(node_id)
            key = None if text is None else decode_public_key(text)
        except Exception as exc:  # noqa: BLE001 - no key, no evidence that stands
            return f"{node_id}'s key cannot be read: {exc}"
        if key is None:
            return f"the tracker knows no key of {node_id}"
        for s, r in zip(steps, receipts):
            why = verify_step(key, model, chain_id, layers, s.position, s.tokens, s.flags, s.frame_in, s.frame_out,
                              r)
            if why:
                return f"{node_id}: {why}"
        return ""

    def _sent_to(self, record: ChainRecord, index: int) -> set[tuple[int, bytes]]:
        """(position, digest) of every frame sent to hop ``index``: the entry's own for the first
        hop (every hop on the HTTP path, where the entry sends each its frames), else the outputs
        the hop before it signed."""
        if record.sent_to:
            return set(record.sent_to[index])
        if index == 0:
            return set(record.sent)
        return {(position, r.out_digest) for (position, _, _), r in self._receipts(record, index - 1).items()}

    async def _witness_run(self, record: ChainRecord, hop: Hop, steps: list[TranscriptStep],
                           codec: ActivationCodec) -> tuple[list[float], "_Replay | None"] | None:
        """Each step's distance (0 for a step that returned nothing) from another holder of
        ``hop.layers`` given the same inputs: runs of ordinary steps as chunked prefills, each
        speculative step as it was (it rewinds the session); with the witness's signed calls
        (None when a call came without a receipt). None when there is no such holder or it failed."""
        model = record.model or ""
        async with witness_session(self.routes, self.client, self.release_auth, model, hop, frozenset()) as found:
            if found is None:
                return None
            witness, session, ticket = found
            calls: list[tuple[int, TranscriptStep, str]] = []  # (the run it replays, the call, its receipt)

            async def call(run: int, position: int, frame: bytes, tokens: int, rewind: bool = False) -> bytes:
                signed: list[str] = []
                out, _ = await post_forward(self.client, witness, model=model, session_id=session, position=position,
                                            frame=frame, last_only=False, timeout=self.timeout_s, codec=codec,
                                            ticket=ticket, rewind=rewind, receipts=signed)
                calls.append((run, TranscriptStep(position, tokens, FLAG_REWIND if rewind else 0, frame, out),
                              signed[0]))
                return out

            distances = []
            try:
                for k, run in enumerate(replay_runs(steps)):
                    start = run[0].position
                    if run[0].flags & FLAG_REWIND:
                        frames = [await call(k, start, run[0].frame_in, run[0].tokens, rewind=True)]
                    else:
                        history = [(s.position, s.frame_in, s.tokens) for s in run]
                        frames = [await call(k, p, f, n)
                                  async for p, f, n in rechunk(history, codec, self.chunk_tokens)]
                    outputs = [(s.position - start, s.tokens, s.flags, s.frame_out) for s in run
                               if s.frame_out is not None]
                    measured = iter(step_distances(outputs, reference_rows(frames)))
                    distances += [next(measured) if s.frame_out is not None else 0.0 for s in run]
            except Exception as exc:  # noqa: BLE001 - a witness that fails is no evidence either way
                log.info("audit witness %s failed: %s", witness.node_id, exc)
                return None
        replay = None
        try:
            if all(r for _, _, r in calls):
                replay = _Replay(witness.node_id, session,
                                 [(k, c, Receipt.from_bytes(unb64url(r))) for k, c, r in calls])
        except (ValueError, MeshnetError) as exc:
            log.info("audit witness %s sent unreadable receipts: %s", witness.node_id, exc)
        return distances, replay


@dataclass(frozen=True)
class _Replay:
    """A witness's signed run of an audited hop's inputs: its calls in order with its receipts."""

    witness: str
    session: str
    calls: list[tuple[int, TranscriptStep, Receipt]]  # (the run of the audited steps it replays, call, receipt)

    def upto(self, steps: list[TranscriptStep]) -> "_Replay":
        """The calls that replayed ``steps`` (a dispute's steps, the audited ones up to the worst):
        those of their runs (:func:`replay_runs`), in the last run up to the call that holds the
        last step's end."""
        runs = replay_runs(steps)
        end = steps[-1].position + steps[-1].tokens
        kept = [(k, c, r) for k, c, r in self.calls
                if k < len(runs) - 1 or (k == len(runs) - 1 and c.position < end)]
        return _Replay(self.witness, self.session, kept)

    @property
    def steps(self) -> list[TranscriptStep]:
        return [c for _, c, _ in self.calls]

    @property
    def receipts(self) -> list[Receipt]:
        return [r for _, _, r in self.calls]


def _audit_steps(steps: list[TranscriptStep], receipts: list[Receipt]) -> list[AuditStep]:
    """``steps`` with their receipts as the report's :class:`AuditStep` list."""
    return [AuditStep(position=s.position, tokens=s.tokens, flags=s.flags, input=b64url(s.frame_in),
                      output=None if s.frame_out is None else b64url(s.frame_out), receipt=b64url(r.to_bytes()))
            for s, r in zip(steps, receipts)]


def _unsigned(steps: list[TranscriptStep] | None, receipts: dict[tuple[int, bytes, int], Receipt]) -> str:
    """Why a hop's transcript is not what it signed during the session ("" when it is)."""
    if steps is None:
        return "the hop keeps no transcript of the chain"
    why = history_problem(steps)
    if why:
        return f"its transcript is no session's history: {why}"
    for s in steps:
        receipt = receipts.get((s.position, digest(s.frame_in), s.flags))
        if receipt is None:
            return f"no receipt came for its step at position {s.position}"
        if receipt.out_digest != digest(s.frame_out):
            return f"its transcript's output at position {s.position} is not the one it signed"
    return ""
