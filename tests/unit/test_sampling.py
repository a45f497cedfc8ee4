"""Next-token sampling (meshnet.gateway.sampling): greedy, seeded temperature, nucleus."""

from __future__ import annotations

import pytest
import torch

from meshnet.gateway.sampling import sample_token


def logits(seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_greedy_picks_argmax(temperature):
    values = logits()
    values[123] = 50.0
    assert sample_token(values, temperature=temperature) == 123


def test_greedy_ties_go_to_the_lowest_id():
    values = torch.zeros(10)
    values[[4, 7]] = 3.0
    assert sample_token(values) == 4


def test_seeded_sampling_is_reproducible():
    values = logits(1)
    draws = [[sample_token(values, temperature=1.0, generator=gen) for _ in range(20)]
             for gen in (torch.Generator().manual_seed(42), torch.Generator().manual_seed(42))]
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1  # it really samples, not argmax
    other = [sample_token(values, temperature=1.0, generator=torch.Generator().manual_seed(43)) for _ in range(20)]
    assert other != draws[0]


def test_tiny_top_p_keeps_only_the_top_token():
    values = logits(2)
    top = int(torch.argmax(values))
    gen = torch.Generator().manual_seed(0)
    assert {sample_token(values, temperature=1.5, top_p=1e-6, generator=gen) for _ in range(50)} == {top}


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # probabilities 0.5, 0.3, 0.2: top_p 0.7 keeps the first two (0.5 < 0.7, 0.8 >= 0.7)
    values = torch.tensor([0.5, 0.3, 0.2]).log()
    gen = torch.Generator().manual_seed(0)
    assert {sample_token(values, temperature=1.0, top_p=0.7, generator=gen) for _ in range(200)} == {0, 1}


def test_low_temperature_concentrates_on_argmax():
    values = logits(3)
    gen = torch.Generator().manual_seed(0)
    assert {sample_token(values, temperature=1e-4, generator=gen) for _ in range(20)} == {int(torch.argmax(values))}
