"""Next-token sampling (meshnet.node.entry): greedy, seeded temperature, nucleus."""

from __future__ import annotations

import math

import pytest
import torch

from meshnet.node.entry import sample_token


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


# ---- penalties, logit bias, log-probabilities (OpenAI API reference formulas) ------------------

from meshnet.node.entry import TokenPicker, adjust_logits, token_logprob  # noqa: E402
from meshnet.protocol.openai import SamplingParams, for_choice


def test_penalties_follow_the_openai_formula():
    # logit[j] - count[j] * frequency - (count[j] > 0) * presence, then + bias
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    counts = torch.tensor([0.0, 1.0, 3.0, 0.0])
    bias = torch.tensor([0.0, 0.0, 0.0, -10.0])
    out = adjust_logits(values, counts, frequency_penalty=0.5, presence_penalty=1.0, bias=bias)
    assert out.tolist() == [1.0, 0.5, 0.5, -6.0]
    assert values.tolist() == [1.0, 2.0, 3.0, 4.0]  # input untouched
    negative = adjust_logits(values, counts, frequency_penalty=-2.0, presence_penalty=-2.0)
    assert negative.tolist() == [1.0, 6.0, 11.0, 4.0]


def test_a_frequency_penalty_moves_greedy_off_a_repeated_token():
    picker = TokenPicker(3, SamplingParams(temperature=0.0, frequency_penalty=1.5))
    values = torch.tensor([0.0, 2.0, 1.0])
    # 2.0 > 1.0: token 1; then 2.0 - 1.5 = 0.5 < 1.0: token 2; then 1.0-1.5 < 0.5: token 1 ...
    assert [picker.pick(values)[0] for _ in range(4)] == [1, 2, 1, 0]
    assert picker.counts.tolist() == [1.0, 2.0, 1.0]


def test_presence_penalty_counts_a_token_once():
    values = torch.tensor([0.0, 1.5])
    presence = TokenPicker(2, SamplingParams(temperature=0.0, presence_penalty=1.0))
    assert [presence.pick(values)[0] for _ in range(3)] == [1, 1, 1]  # 1.5 - 1 stays above 0
    frequency = TokenPicker(2, SamplingParams(temperature=0.0, frequency_penalty=1.0))
    assert [frequency.pick(values)[0] for _ in range(3)] == [1, 1, 0]  # 1.5 - 2 falls below 0


def test_logit_bias_forces_and_bans_tokens():
    values = torch.tensor([5.0, 0.0, 1.0])
    forced = TokenPicker(3, SamplingParams(temperature=1.0, logit_bias=((1, 100.0),)),
                         torch.Generator().manual_seed(0))
    assert {forced.pick(values)[0] for _ in range(20)} == {1}
    banned = TokenPicker(3, SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)))
    assert banned.pick(values)[0] == 2


def test_logit_bias_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TokenPicker(3, SamplingParams(logit_bias=((3, 1.0),)))


def test_token_logprob_is_log_softmax_with_sorted_alternatives():
    values = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    lp = token_logprob(values, 1, top=3)
    assert lp.token_id == 1 and lp.logprob == pytest.approx(math.log(0.25))
    # ties (ids 2 and 3) keep the lower id first
    assert [t for t, _ in lp.top] == [0, 1, 2]
    assert [v for _, v in lp.top] == pytest.approx([math.log(0.5), math.log(0.25), math.log(0.125)])
    assert token_logprob(values, 0).top == ()


def test_picker_logprobs_are_of_the_adjusted_logits_and_ignore_temperature():
    values = torch.tensor([1.0, 1.0])
    params = SamplingParams(temperature=0.0, logit_bias=((1, math.log(3.0)),), top_logprobs=2)
    token, lp = TokenPicker(2, params).pick(values)
    assert token == 1 and lp.logprob == pytest.approx(math.log(0.75))
    hot = TokenPicker(2, SamplingParams(temperature=2.0, top_logprobs=0), torch.Generator().manual_seed(0))
    assert hot.pick(values)[1].logprob == pytest.approx(math.log(0.5))
    assert TokenPicker(2, SamplingParams()).pick(values)[1] is None  # not asked for


def test_choice_seeds_are_seed_plus_index_modulo_2_63():
    params = SamplingParams(seed=7)
    assert [for_choice(params, i).seed for i in range(3)] == [7, 8, 9]
    assert for_choice(SamplingParams(seed=2**63 - 1), 1).seed == 0
    assert for_choice(SamplingParams(), 2).seed is None
