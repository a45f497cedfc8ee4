"""Speculative decoding at the entry: drafts, and how many of them one traversal verifies (ADR-0058).

A decode step costs one traversal of the whole chain, whatever it carries: every hop's per-step
overhead and every link's latency are paid per traversal, and a small step of a CPU shard reads
all its weights once however many positions it holds. The entry therefore sends the last chosen
token together with ``k`` drafted tokens as one step of ``k + 1`` positions; its LM head scores
all of them, and the longest prefix of drafts that equals what the token choice picks is kept
(with the choice's pick at the first difference, or one more token after the last draft).

- :class:`PromptLookup` drafts by n-gram match over the prompt and the text generated so far
  (prompt lookup decoding: no draft model, it pays where the answer copies its context). Other
  draft sources (a small model held by the entry, an early-exit head) implement
  :class:`DraftSource`.
- :class:`SpeculationPolicy` chooses ``k`` per step from the session's observed acceptance and
  the mesh's measured cost of a step by its positions, so that drafting never slows a session
  down: the expected tokens per traversal of Leviathan et al. 2023 ("Fast Inference from
  Transformers via Speculative Decoding", eq. 1), ``(1 - a^(k+1)) / (1 - a)`` for a per-draft
  acceptance ``a``, over the step's cost.

Why the output is unchanged: the token at each position is picked by the same choice (penalties,
bias, grammar, temperature, top-p, the seeded generator) from the same logits as plain decoding
would, in the same order, and a draft is kept only when it equals that pick. For sampling with
a deterministic draft (a one-hot proposal ``q``) this is the speculative sampling rule itself:
the draft ``x`` is kept with probability ``p(x)``, and on rejection the pick is distributed as
``p`` without ``x``, the normalised residual ``max(0, p - q)``. So greedy output is identical
and a seeded sampled run draws exactly the generator values plain decoding draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from meshnet.errors import InvalidRequest

#: the most drafts ``auto`` puts in one step (the hops' rewind limit, ``MAX_REWIND``, is larger)
AUTO_MAX_DRAFTS = 8
#: the most drafts a fixed ``--speculate K`` may ask for
MAX_DRAFTS = 16
#: longest and shortest n-gram :class:`PromptLookup` matches (the longest match is tried first)
MAX_NGRAM, MIN_NGRAM = 3, 1
#: ``auto`` drafts only when the expected tokens per second beat plain decoding by this factor
MIN_GAIN = 1.05
#: a session that stopped drafting tries a short draft again after this many plain steps (its
#: acceptance is only learnt by drafting)
PROBE_EVERY = 16
#: weight of the newest observation in the acceptance and cost averages
DECAY = 0.3


class DraftSource(Protocol):
    """Proposes tokens that may follow a session's text."""

    def extend(self, tokens: list[int]) -> None:
        """The session's text grew by ``tokens`` (the prompt first, then each chosen token)."""

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that may follow the text so far (possibly none)."""


class PromptLookup:
    """Drafts by n-gram match: the last ``n`` tokens of the text (``n`` from :data:`MAX_NGRAM` down
    to :data:`MIN_NGRAM`) are looked up at their latest earlier occurrence, and the tokens that
    followed it there are proposed. An index of each n-gram's latest occurrence is kept as the text
    grows, so a proposal costs ``O(MAX_NGRAM + limit)`` whatever the length of the text. Where
    the tokens after the match run into the end of the text, the copy goes on over its own
    proposal, as an LZ77 back-reference does: a text that repeats a period is drafted repeating it.
    """

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min <= max, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        #: n-gram -> start of its latest occurrence that some token follows
        self._latest: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        text = self.tokens
        for token in tokens:
            end = len(text)  # the n-grams ending just before ``token`` are now followed by it
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._latest[tuple(text[end - n:end])] = end - n
            text.append(token)

    def propose(self, limit: int) -> list[int]:
        text = self.tokens
        if limit <= 0:
            return []
        for n in range(min(self.max_ngram, len(text)), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(text[-n:]))
            if start is None:
                continue
            # copy what followed the match; where the copy reaches the end of the text it goes on with
            # the tokens it has just proposed (an overlapping copy: a repeating text keeps repeating)
            out, source = [], start + n
            while len(out) < limit:
                out.append(text[source] if source < len(text) else out[source - len(text)])
                source += 1
            return out
        return []


def parse_speculate(value: str | int) -> int | None:
    """``--speculate``'s value: ``off`` → 0, ``auto`` → None (adaptive), an integer K (0 ..
    :data:`MAX_DRAFTS`) → K drafts whenever the draft source has them.

    Raises:
        InvalidRequest: anything else (names the flag and the accepted values).
    """
    text = str(value).strip().lower()
    if text == "off":
        return 0
    if text == "auto":
        return None
    try:
        k = int(text)
    except ValueError:
        k = -1
    if not 0 <= k <= MAX_DRAFTS:
        raise InvalidRequest(f"--speculate takes off, auto or a draft count 0..{MAX_DRAFTS}, not {value!r}",
                             code="invalid_field", param="speculate")
    return k


@dataclass
class StepCosts:
    """The mesh's measured traversal time of a decode step by its positions, shared by the sessions
    of one entry: ``single_s`` the average of one-position steps, ``extra_s`` the average cost of
    each further position (seconds), both moving averages (weight :data:`DECAY`). Until a
    multi-position step has been measured, each extra position is assumed to cost a tenth of a
    single step (a CPU shard's step is bound by its weight bytes, read once per step)."""

    single_s: float | None = None
    extra_s: float | None = None
    #: sessions of the entry decoding now (their steps share the nodes' batches)
    decoding: int = 0

    def observe(self, positions: int, seconds: float) -> None:
        if positions <= 1:
            self.single_s = seconds if self.single_s is None else (1 - DECAY) * self.single_s + DECAY * seconds
            return
        if self.single_s is None:
            return
        per = max(0.0, (seconds - self.single_s) / (positions - 1))
        self.extra_s = per if self.extra_s is None else (1 - DECAY) * self.extra_s + DECAY * per

    def cost(self, positions: int, sharing: int = 1) -> float:
        """Expected seconds of a step of ``positions`` positions (1.0 per step before any measure),
        its extra positions counted ``sharing`` times: the sessions that share a batch with it
        each wait for them too (a node runs the steps of concurrent sessions as one batch)."""
        single = self.single_s or 1.0
        extra = self.extra_s if self.extra_s is not None else 0.1 * single
        return single + extra * (positions - 1) * max(1, sharing)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one traversal yields on average with ``k`` drafts each kept with probability
    ``acceptance`` until the first rejection: ``(1 - a^(k+1)) / (1 - a)`` (Leviathan et al. 2023,
    eq. 1); ``k + 1`` when every draft is kept."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


@dataclass
class SpeculationPolicy:
    """How many drafts one session's next step carries.

    Args:
        fixed: None for ``auto`` (adaptive), else the draft count asked for (0: off).
        costs: the entry's shared :class:`StepCosts`.
        max_drafts: the most drafts ``auto`` chooses.
    """

    fixed: int | None
    costs: StepCosts
    max_drafts: int = AUTO_MAX_DRAFTS
    #: decayed counts of kept and rejected drafts (a uniform prior: acceptance 0.5 to begin with)
    kept: float = 1.0
    rejected: float = 1.0
    plain_steps: int = 0

    @property
    def acceptance(self) -> float:
        """The session's estimated chance that a draft is kept (given the ones before it were)."""
        return self.kept / (self.kept + self.rejected)

    def drafts(self, available: int, sharing: int = 1) -> int:
        """Drafts for the next step, given that the draft source has ``available`` of them and that
        ``sharing`` sessions of this entry generate at once (each extra position slows all of
        them when their steps batch: :meth:`StepCosts.cost`)."""
        if self.fixed is not None:
            return min(self.fixed, available)
        if available <= 0:
            return 0
        a, costs = self.acceptance, self.costs
        plain = 1.0 / costs.cost(1)
        best_k, best = 0, plain * MIN_GAIN
        for k in range(1, min(available, self.max_drafts) + 1):
            rate = expected_tokens(a, k) / costs.cost(k + 1, sharing)
            if rate > best:
                best_k, best = k, rate
        if best_k == 0 and self.plain_steps >= PROBE_EVERY:
            best_k = min(2, available)  # learn the acceptance again: it changes with the text
        return best_k

    def observe(self, drafted: int, kept: int, positions: int, seconds: float) -> None:
        """A step of ``positions`` positions carrying ``drafted`` drafts, of which ``kept`` were kept,
        took ``seconds`` (its traversal, the LM head included)."""
        self.costs.observe(positions, seconds)
        if drafted == 0:
            self.plain_steps += 1
            return
        self.plain_steps = 0
        self.kept = (1 - DECAY) * self.kept + kept
        self.rejected = (1 - DECAY) * self.rejected + (1 if kept < drafted else 0)
