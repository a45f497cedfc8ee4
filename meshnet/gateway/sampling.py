"""Next-token sampling: greedy, temperature and nucleus (top-p), seeded."""

from __future__ import annotations

import torch


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
