"""Audit verdicts are the tracker's (ADR-0067): an entry brings the accused's own signed steps, the
tracker re-runs them on holders it picks and decides.

An entry whose audit (:mod:`meshnet.gateway.audit`) found a hop's outputs away from a second
holder's sends ``POST /v1/nodes/{id}/audit`` with every step of the chain from position 0 to the
disputed one: the frames the hop received and sent, each with the hop's signed receipt
(:mod:`meshnet.dataplane.receipts`). The tracker:

1. checks that the sender had the accused on a route (its ticket names both, for that chain);
2. checks every receipt against the accused's key: evidence the accused did not sign is forged,
   and forging it is the sender's fault (:data:`FORGED`: the sender is quarantined at once);
3. re-runs the inputs, as one fresh session each, on up to :data:`WITNESSES` admitted holders of
   the same layers and recipe that are neither the accused nor the sender, and compares every
   step's output with theirs (:func:`judge_audit`):

   - the witnesses agree with each other and all disagree with the accused: the accused is
     quarantined, on the tracker's own measurements;
   - they agree with each other and with the accused, clearly (within :data:`CLEAR` of the
     tolerance): the accusation was false; a sender with :data:`FALSE_ACCUSATIONS` of them, more
     than its upheld ones, is quarantined itself (an honest entry whose own witness lied to it
     makes some, and its other disputes catch that liar);
   - the accused and one witness agree and the other witness does not: that witness lied to the
     tracker itself (``witness_outvoted``): it is quarantined on the tracker's own measurements,
     and the accusation counts against no one (the sender's own witness may have been that one);
   - anything else (fewer than two witnesses answered, no two of the three agree, or the accused
     near the tolerance) is ``inconclusive``: nothing changes, and the answer says so.

4. a false accusation that came with the entry's own witness's signed replay of the same inputs
   (:func:`judge_replay`, ADR-0067 amended 2026-12-07) is looked at once more: when the replay is
   that witness's (its receipts verify with its key, under the session it names), ran the
   accused's very inputs, and its outputs are beyond the tolerance from the accused's and from
   every one of the tracker's witnesses (the entry's witness is asked last, only where no other
   holder is left; then its own re-run is one of them), that witness lied to the entry: it is
   quarantined (``replay_outvoted``) and the entry's dispute counts as upheld. An honest entry is
   then never marked for what its witness did. The receipts sign the layers run, so neither the
   accused's steps nor the replay can be claimed for other layers than they ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from meshnet.dataplane.evidence import reference_rows, step_distances
from meshnet.dataplane.frames import FLAG_REWIND, read_array
from meshnet.dataplane.receipts import Receipt, TranscriptStep, history_problem, replay_runs, verify_step
from meshnet.errors import MeshnetError
from meshnet.layers import LayerRange
from meshnet.protocol.control import AuditReplay, AuditReport, AuditStep
from meshnet.protocol.signing import unb64url
from meshnet.tracker.admission import Holder
from meshnet.presets import canonical_model_name

__all__ = ["FALSE_ACCUSATIONS", "FORGED", "REPLAY_OUTVOTED", "WITNESSES", "AuditCase", "AuditVerdict", "judge_audit",
           "judge_replay", "read_evidence", "read_replay"]

#: holders the tracker re-runs a disputed session on (two: a vote needs a majority without the accused)
WITNESSES = 2
#: false accusations (the witnesses agreed with the accused) at which the accuser is quarantined, when
#: they also outnumber its upheld ones
FALSE_ACCUSATIONS = 3
#: the verdict of evidence the accused did not sign
FORGED = "forged"
#: a false accusation needs the accused within this share of the tolerance of every witness: between
#: it and the tolerance the entry's measurement (a chunked replay on its own witness) may honestly
#: have come out beyond, so the verdict is inconclusive (ADR-0067; honest same-recipe distances
#: measured across weight layouts and thread counts: max 0.0138, against the bfloat16 audit tolerance
#: 0.018, :data:`meshnet.dataplane.evidence.AUDIT_TOLERANCE`; on one layout they are 0.0)
CLEAR = 0.5
#: the verdict on an entry's witness whose signed replay the accused and the tracker's witnesses outvote
REPLAY_OUTVOTED = "replay_outvoted"
#: the distance recorded for outputs that cannot be compared (other shapes, non-finite values; JSON has no inf)
UNREADABLE = 1e9


@dataclass(frozen=True)
class AuditCase:
    """A dispute the tracker will re-run: who accuses whom over which layers and recipe, the
    accused's signed steps, the witnesses picked and the tolerance that applies."""

    sender: str
    accused: Holder
    model: str
    layers: LayerRange
    chain_id: str
    steps: tuple[TranscriptStep, ...]
    witnesses: tuple[Holder, ...]
    limit: float



@dataclass(frozen=True)
class AuditVerdict:
    """``state``: ``quarantine`` (the accused is outvoted), ``false_accusation``, ``witness_outvoted``
    (the accused and one witness agree against the other witness, ``outvoted``), ``inconclusive``
    or :data:`FORGED`; why, and the measured distances (keyed ``"a|b"``: the largest step distance
    between two holders' outputs)."""

    state: str
    reason: str
    distances: dict[str, float] = field(default_factory=dict)
    outvoted: str | None = None  # the witness a ``witness_outvoted`` verdict names

    def to_json(self) -> dict:
        out = {"verdict": self.state, "reason": self.reason, "distances": dict(self.distances)}
        return {**out, "outvoted": self.outvoted} if self.outvoted else out


def read_evidence(report: AuditReport, public_key) -> tuple[list[TranscriptStep], str]:
    """The report's steps, and why they are not the accused's own ("" when every step's receipt
    verifies with ``public_key`` through the report's layers, the steps are one session's history
    from position 0, and one of them at least returned something to judge). Unreadable steps are a reason, not an error:
    broken evidence is its sender's fault either way."""
    steps, why = _signed_steps(report.steps, canonical_model_name(report.model), report.chain_id, report.layers,
                               public_key)
    if not why and not any(s.frame_out is not None for s in steps):
        return [], "no step carries an output to judge"
    return steps, why


def read_replay(replay: AuditReplay, model: str, layers: LayerRange, public_key) -> tuple[list[TranscriptStep], str]:
    """The replay's calls, and why they are not its witness's own run of ``layers`` of ``model`` (""
    when every receipt verifies with ``public_key``, the witness's, under the replay's session and
    through those layers of that model, the calls are one session's history from position 0 and each
    returned its positions)."""
    steps, why = _signed_steps(replay.steps, canonical_model_name(model), replay.session, layers, public_key)
    if not why and any(s.frame_out is None for s in steps):
        return [], "a replay call returned nothing"
    return steps, why


def _signed_steps(body: list[AuditStep], model: str, session: str, layers: LayerRange,
                  public_key) -> tuple[list[TranscriptStep], str]:
    """``body`` as steps of ``session``, and why they are not what ``public_key``'s node signed as
    one session's history through ``layers`` ("" when they are). Unreadable steps are a reason, not
    an error."""
    steps = []
    for i, step in enumerate(body):
        try:
            frame_in = unb64url(step.input)
            frame_out = None if step.output is None else unb64url(step.output)
            receipt = Receipt.from_bytes(unb64url(step.receipt))
        except (ValueError, MeshnetError) as exc:
            return [], f"step {i} does not decode: {exc}"
        why = verify_step(public_key, model, session, layers, step.position, step.tokens, step.flags, frame_in,
                          frame_out, receipt)
        if why:
            return [], why
        steps.append(TranscriptStep(step.position, step.tokens, step.flags, frame_in, frame_out))
    why = history_problem(steps)
    if why:
        return [], f"the steps are no session's history: {why}"
    return steps, ""


def _rows(frame: bytes) -> np.ndarray:
    array = read_array(frame)
    return array.reshape(-1, array.shape[-1])


def _distance(frame: bytes, reference: bytes) -> float:
    """Relative L2 distance of an output to a reference run's output of the same step: over the
    positions ``frame`` holds (the last ones of the step when it returned only its last)."""
    a, b = _rows(frame), _rows(reference)
    b = b[b.shape[0] - a.shape[0]:] if a.shape[0] <= b.shape[0] else None
    if b is None or a.shape != b.shape or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return UNREADABLE
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-12))


def judge_audit(case: AuditCase, runs: dict[str, list[bytes]]) -> AuditVerdict:
    """The verdict on ``case`` from the witnesses' runs (node id -> its output frames, one per step
    of the case, every position; a witness that failed is absent). Distances are the largest
    over the steps. See the module doc for the rule.

    Raises:
        WireError: a frame does not read.
    """
    accused = case.accused.node_id
    judged = [i for i, s in enumerate(case.steps) if s.frame_out is not None]
    distances = {f"{accused}|{w}": max(_distance(case.steps[i].frame_out, frames[i]) for i in judged)
                 for w, frames in runs.items()}
    names = sorted(runs)
    for k, a in enumerate(names):
        for b in names[k + 1:]:
            distances[f"{a}|{b}"] = max(_distance(runs[a][i], runs[b][i]) for i in judged)
    distances = {k: round(min(v, UNREADABLE), 6) for k, v in distances.items()}
    if len(runs) < 2:
        return AuditVerdict("inconclusive", f"{len(runs)} witness(es) answered; a verdict needs two", distances)
    if any(distances[f"{a}|{b}"] > case.limit for k, a in enumerate(names) for b in names[k + 1:]):
        odd = [w for w in names if distances[f"{accused}|{w}"] > case.limit]
        if len(names) == 2 and len(odd) == 1:  # the accused and the other witness agree against it
            return AuditVerdict("witness_outvoted", f"{accused} and {next(w for w in names if w not in odd)} agree "
                                                   f"with each other and not with {odd[0]} (tolerance {case.limit})",
                                distances, odd[0])
        return AuditVerdict("inconclusive", "the witnesses disagree with each other", distances)
    away = [w for w in names if distances[f"{accused}|{w}"] > case.limit]
    if len(away) == len(names):
        return AuditVerdict("quarantine", f"{', '.join(names)} agree with each other and not with {accused} "
                                          f"(tolerance {case.limit})", distances)
    if not away and all(distances[f"{accused}|{w}"] <= CLEAR * case.limit for w in names):
        return AuditVerdict("false_accusation", f"{', '.join(names)} agree with {accused} within {CLEAR} of the "
                                                f"tolerance {case.limit}", distances)
    if not away:
        return AuditVerdict("inconclusive", f"{accused} is near the tolerance {case.limit}: an honest entry may have "
                                            f"measured it beyond", distances)
    return AuditVerdict("inconclusive", "the witnesses split on the accused", distances)


def judge_replay(case: AuditCase, replay: list[TranscriptStep], witness: str, runs: dict[str, list[bytes]],
                 verdict: AuditVerdict) -> AuditVerdict:
    """The verdict on a false accusation (``verdict``) that came with the signed replay of the
    entry's own witness ``witness`` (calls read by :func:`read_replay`), given the tracker's
    witnesses' ``runs`` of the case (as :func:`judge_audit`'s).

    The replay counts when it ran the accused's inputs: cut by :func:`replay_runs`, its calls form
    one group per run of the case's steps, at the same positions, with the same input rows (the
    last group may hold more positions: a chunk past the disputed step). Then each judged step's
    output is measured against the replay's rows of it, and so is each tracker witness's output.
    Beyond the tolerance from the accused and from every tracker witness (at least two, as for any
    verdict; ``witness`` itself may be one of them, where a range has three holders: then its own
    re-run for the tracker disagrees with what it signed for the entry): :data:`REPLAY_OUTVOTED`,
    naming ``witness``. Otherwise ``verdict`` stands, its reason saying why the replay did not
    change it. Either adds each holder's largest distance to the replay to the distances, keyed
    ``"<holder>|<witness>"`` (``"<witness>|<witness>"``: its own re-run against its replay).

    Raises:
        WireError: a frame does not read.
    """
    def stands(why: str) -> AuditVerdict:
        return replace(verdict, reason=f"{verdict.reason}; the entry's witness {witness}'s replay {why}")

    if witness == case.accused.node_id:
        return stands("comes from the accused")
    if len(runs) < 2:
        return stands(f"is weighed against {len(runs)} witness(es) of the tracker; that needs two")
    mine, theirs = replay_runs(list(case.steps)), replay_runs(replay)
    if len(theirs) != len(mine):
        return stands(f"has {len(theirs)} run(s) where the steps have {len(mine)}")
    judged = [i for i, s in enumerate(case.steps) if s.frame_out is not None]
    against = {case.accused.node_id: [0.0] * len(case.steps), **{w: [0.0] * len(case.steps) for w in runs}}
    first = 0  # index in case.steps of the run's first step
    for k, (run, calls) in enumerate(zip(mine, theirs)):
        start = run[0].position
        if calls[0].position != start or bool(calls[0].flags & FLAG_REWIND) != bool(run[0].flags & FLAG_REWIND):
            return stands(f"does not start run {k} as the steps do (position {calls[0].position}, not {start})")
        given, replayed = reference_rows([s.frame_in for s in run]), reference_rows([c.frame_in for c in calls])
        if replayed.shape[0] < given.shape[0] or not np.array_equal(replayed[:given.shape[0]], given):
            return stands(f"did not run the accused's inputs in run {k} (from position {start})")
        rows = reference_rows([c.frame_out for c in calls])
        for j, step in enumerate(run):
            i = first + j
            if i not in judged:
                continue
            offset = step.position - start
            against[case.accused.node_id][i] = step_distances([(offset, step.tokens, step.flags, step.frame_out)],
                                                              rows)[0]
            for w, frames in runs.items():  # the tracker's runs return every position of the step
                against[w][i] = step_distances([(offset, step.tokens, 0, frames[i])], rows)[0]
        first += len(run)
    worst = {name: round(min(max(d[i] for i in judged), UNREADABLE), 6) for name, d in against.items()}
    distances = {**verdict.distances, **{f"{name}|{witness}": d for name, d in worst.items()}}
    if all(d > case.limit for d in worst.values()):
        return AuditVerdict(REPLAY_OUTVOTED, f"the entry's witness {witness} signed a replay of the accused's inputs "
                                             f"that {', '.join(sorted(worst))} all disagree with (tolerance "
                                             f"{case.limit}): it lied to the entry", distances, witness)
    return replace(verdict, reason=f"{verdict.reason}; the entry's witness {witness}'s replay agrees with "
                                   f"{', '.join(n for n in sorted(worst) if worst[n] <= case.limit)}",
                   distances=distances)
