"""Speculative decoding's pure parts (ADR-0058): drafts, the draft count, cache rewinds, history cuts."""

from __future__ import annotations

import pytest
import torch

from meshnet.dataplane.replay import cut_history
from meshnet.errors import InvalidRequest, SessionConflict
from meshnet.gateway.speculation import (PROBE_EVERY, PromptLookup, SpeculationPolicy, StepCosts, expected_tokens,
                                         parse_speculate)
from meshnet.models.caches import MAX_REWIND, KVCache
from meshnet.node.entry import WireCodec
from meshnet.node.sessions import SessionStore


def lookup(tokens: list[int]) -> PromptLookup:
    drafter = PromptLookup()
    drafter.extend(tokens)
    return drafter


def test_prompt_lookup_copies_what_followed_the_longest_latest_match():
    # "1 2 3" last seen at 4 (followed by 9 8), "2 3" and "3" too: the longest match wins
    assert lookup([1, 2, 3, 7, 1, 2, 3, 9, 8, 5, 2, 3]).propose(2) == [9, 8]
    assert lookup([1, 2, 3, 7, 1, 2, 3, 9, 8, 5, 2, 3]).propose(5) == [9, 8, 5, 2, 3]
    assert lookup([4, 5, 6, 4, 5]).propose(3) == [6, 4, 5]
    assert lookup([4, 5, 6, 7]).propose(3) == []  # 7 never occurred before
    assert lookup([4, 5, 6, 4]).propose(0) == []


def test_prompt_lookup_drafts_a_repeating_text_repeating():
    assert lookup([9, 9]).propose(4) == [9, 9, 9, 9]
    assert lookup([1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]


def test_prompt_lookup_grows_with_the_text():
    drafter = lookup([10, 11, 12, 13])
    assert drafter.propose(2) == []
    drafter.extend([10])
    assert drafter.propose(3) == [11, 12, 13]
    drafter.extend([11, 12])
    assert drafter.propose(2) == [13, 10]


@pytest.mark.parametrize(("value", "parsed"), [("off", 0), ("auto", None), ("AUTO", None), ("0", 0), ("5", 5),
                                               (16, 16)])
def test_speculate_values(value, parsed):
    assert parse_speculate(value) == parsed


@pytest.mark.parametrize("value", ["17", "-1", "some", ""])
def test_a_bad_speculate_value_names_the_flag(value):
    with pytest.raises(InvalidRequest) as info:
        parse_speculate(value)
    assert info.value.message == f"--speculate takes off, auto or a draft count 0..16, not {value!r}"


def test_expected_tokens_per_traversal():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.9, 4) == pytest.approx((1 - 0.9 ** 5) / 0.1)
    assert expected_tokens(1.0, 4) == 5.0


def costs(single: float, extra: float) -> StepCosts:
    return StepCosts(single_s=single, extra_s=extra)


def test_auto_drafts_many_when_they_are_kept_and_cheap_and_none_when_they_are_not():
    policy = SpeculationPolicy(None, costs(0.1, 0.005))
    policy.kept, policy.rejected = 30.0, 0.5
    assert policy.drafts(8) == 8
    assert policy.drafts(3) == 3
    assert policy.drafts(0) == 0
    policy.kept, policy.rejected = 0.2, 5.0
    assert policy.drafts(8) == 0
    expensive = SpeculationPolicy(None, costs(0.1, 0.1))  # a position costs as much as a step: never pays
    expensive.kept, expensive.rejected = 30.0, 0.5
    assert expensive.drafts(8) == 0


def test_a_fixed_count_drafts_what_it_can():
    assert SpeculationPolicy(4, StepCosts()).drafts(8) == 4
    assert SpeculationPolicy(4, StepCosts()).drafts(2) == 2
    assert SpeculationPolicy(0, StepCosts()).drafts(8) == 0


def test_auto_learns_acceptance_and_cost_and_tries_again_after_plain_steps():
    shared = StepCosts()
    policy = SpeculationPolicy(None, shared)
    policy.observe(0, 0, 1, 0.10)
    policy.observe(4, 0, 5, 0.30)  # every draft rejected, and four positions cost 0.05 s each
    assert shared.single_s == pytest.approx(0.10) and shared.extra_s == pytest.approx(0.05)
    assert policy.acceptance == pytest.approx(0.7 / (0.7 + 1.7))
    for _ in range(3):
        policy.observe(4, 0, 5, 0.30)
    assert policy.drafts(8) == 0
    for _ in range(PROBE_EVERY):
        policy.observe(0, 0, 1, 0.10)
    assert policy.drafts(8) == 2  # a short probe: acceptance changes with the text


def test_a_cache_rewound_forgets_its_last_positions_and_takes_the_next_in_their_place():
    cache = KVCache(block_tokens=4)
    k = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(1, 2, 6, 3)
    cache.update(k, -k, 0)
    cache.rewind(2)
    assert cache.get_seq_length(0) == 4
    new = torch.full((1, 2, 1, 3), 99.0)
    keys, values = cache.update(new, -new, 0)
    assert torch.equal(keys, torch.cat([k[..., :4, :], new], dim=-2))
    assert torch.equal(values, -keys)


def test_a_rewind_past_the_limit_or_over_recurrent_state_is_refused():
    cache = KVCache()
    cache.update(torch.zeros(1, 1, 40, 2), torch.zeros(1, 1, 40, 2), 0)
    with pytest.raises(ValueError, match=f"a rewind goes back 1..{MAX_REWIND} positions, not {MAX_REWIND + 1}"):
        cache.rewind(MAX_REWIND + 1)
    cache.conv[1] = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="linear-attention layers keep no per-position history"):
        cache.rewind(1)


def test_a_session_goes_back_only_on_a_speculative_step():
    store = SessionStore()
    session = store.acquire("s", "slot", 0)
    session.cache.update(torch.zeros(1, 1, 10, 2), torch.zeros(1, 1, 10, 2), 0)
    store.commit(session, 10)
    with pytest.raises(SessionConflict, match="holds 10 tokens, request is at position 7"):
        store.acquire("s", "slot", 7)
    assert store.acquire("s", "slot", 7, rewind=True).length == 7
    assert session.cache.get_seq_length(0) == 7
    assert store.acquire("s", "slot", 7, rewind=True).length == 7  # nothing to forget: as a plain step
    with pytest.raises(SessionConflict, match="holds 7 tokens, request is at position 9"):
        store.acquire("s", "slot", 9, rewind=True)  # a rewind never goes forward


async def test_a_history_cut_keeps_the_positions_before_the_cut_frame_by_frame():
    codec = WireCodec("float32")
    hidden = torch.arange(10 * 2, dtype=torch.float32).reshape(1, 10, 2)
    history = [(0, await codec.encode(hidden[:, :6]), 6, "a"), (6, await codec.encode(hidden[:, 6:7]), 1, "b"),
               (7, await codec.encode(hidden[:, 7:10]), 3, "c")]
    cut = await cut_history(history, 8, codec)
    assert [(p, t, extra) for p, _, t, extra in cut] == [(0, 6, "a"), (6, 1, "b"), (7, 1, "c")]
    assert cut[0][1] is history[0][1]
    assert torch.equal(await codec.decode(cut[2][1]), hidden[:, 7:8])
    assert await cut_history(history, 10, codec) == history
    assert [p for p, *_ in await cut_history(history, 6, codec)] == [0]


def test_under_load_only_drafts_that_are_mostly_kept_pay():
    """Eight sessions share each batch: a step's extra positions cost all of them (ADR-0058)."""
    shared = costs(0.1, 0.01)
    policy = SpeculationPolicy(None, shared)
    policy.kept, policy.rejected = 1.0, 3.0  # a quarter kept: drafting pays alone, not beside seven others
    assert policy.drafts(8, sharing=1) == 1
    assert policy.drafts(8, sharing=8) == 0
    policy.kept, policy.rejected = 30.0, 0.5
    assert policy.drafts(8, sharing=1) == 8
    assert policy.drafts(8, sharing=8) == 4  # fewer than alone (8): each costs the batch more
    assert shared.cost(5, sharing=8) == pytest.approx(0.1 + 0.01 * 4 * 8)
