"""Next-token choice: logit adjustments (penalties, bias), greedy/temperature/top-p sampling,
log-probabilities. Pure functions over tensors plus one small stateful :class:`TokenPicker`."""

from __future__ import annotations

import torch

from meshnet.gateway.entry import TokenLogprob
from meshnet.protocol.openai import SamplingParams


def sample_token(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """Pick the next token id from ``logits`` ``[vocab]`` (float32).

    ``temperature <= 0`` is greedy (argmax, ties to the lowest id as ``torch.argmax``).
    Otherwise softmax(logits / temperature), restricted to the smallest set of tokens whose
    probability mass reaches ``top_p`` (Holtzman et al. 2019, "The Curious Case of Neural
    Text Degeneration"), sampled with ``generator`` (seeded per request for reproducibility).
    """
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        keep = cumulative - sorted_probs < top_p
        keep[0] = True
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = sorted_probs[keep]
        probs = filtered / filtered.sum()
    return int(torch.multinomial(probs, 1, generator=generator))


def adjust_logits(logits: torch.Tensor, counts: torch.Tensor | None, *, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Logits after OpenAI's penalties and logit bias (a new float32 tensor ``[vocab]``).

    As the OpenAI API reference documents them ("frequency and presence penalties"):
    ``logit[j] - counts[j] * frequency_penalty - (counts[j] > 0) * presence_penalty``, where
    ``counts[j]`` (float32 ``[vocab]``) is how often token ``j`` was generated so far in this
    choice (prompt tokens do not count; None when neither penalty is set); then ``bias`` (float32 ``[vocab]``, the request's
    ``logit_bias`` scattered over the vocabulary, zeros elsewhere) is added.
    """
    out = logits.float().clone()
    if frequency_penalty:
        out -= counts * frequency_penalty
    if presence_penalty:
        out -= (counts > 0).float() * presence_penalty
    if bias is not None:
        out += bias
    return out


def token_logprob(logits: torch.Tensor, token_id: int, top: int = 0) -> TokenLogprob:
    """``log_softmax(logits)`` at ``token_id`` and the ``top`` (0..20) best tokens' values.

    ``logits`` ``[vocab]`` are the adjusted logits (:func:`adjust_logits`), before temperature
    and top-p: the model's distribution as the request's penalties and bias shape it, so the
    values do not depend on the sampling temperature and exist for greedy decoding too.
    """
    logp = torch.log_softmax(logits.double(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        # stable sort: ties keep the lowest id first (topk's tie order is unspecified)
        values, ids = torch.sort(logp, descending=True, stable=True)
        best = tuple((int(i), float(v)) for i, v in zip(ids[:top], values[:top]))
    return TokenLogprob(token_id, float(logp[token_id]), best)


class TokenPicker:
    """Chooses one choice's tokens step by step: adjusts the logits by the penalties (counting
    the tokens it picked) and ``logit_bias``, samples, and records log-probabilities when the
    request asked for them (``params.top_logprobs`` not None).

    Args:
        vocab_size: length of the logits it will be given.
        params: the choice's settings; ``logit_bias`` ids must be below ``vocab_size``.
        generator: seeded generator of the choice (None: torch's global one).
    Raises:
        ValueError: a ``logit_bias`` id outside the vocabulary.
    """

    def __init__(self, vocab_size: int, params: SamplingParams, generator: torch.Generator | None = None) -> None:
        self.params, self.generator = params, generator
        # generated-token counts: read only by the penalties, so kept only when one is asked for
        self.counts = (torch.zeros(vocab_size, dtype=torch.float32)
                       if params.frequency_penalty or params.presence_penalty else None)
        self.bias = None
        if params.logit_bias:
            ids = [i for i, _ in params.logit_bias]
            if max(ids) >= vocab_size:
                raise ValueError(f"token id {max(ids)} is outside the vocabulary (0..{vocab_size - 1})")
            self.bias = torch.zeros(vocab_size, dtype=torch.float32)
            self.bias[ids] = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        self._adjusts = bool(params.frequency_penalty or params.presence_penalty or self.bias is not None)

    def pick(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """Next token id from ``logits`` ``[vocab]`` and its :class:`TokenLogprob` (or None)."""
        p = self.params
        if self._adjusts:
            logits = adjust_logits(logits, self.counts, frequency_penalty=p.frequency_penalty,
                                   presence_penalty=p.presence_penalty, bias=self.bias)
        token = sample_token(logits, temperature=p.temperature, top_p=p.top_p, generator=self.generator)
        if self.counts is not None:
            self.counts[token] += 1
        logprob = None if p.top_logprobs is None else token_logprob(logits, token, p.top_logprobs)
        return token, logprob
