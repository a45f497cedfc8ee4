"""Speculative decoding across a chain of real node apps (ADR-0058), tiny seeded model, float32.

The nodes of :mod:`test_hop_streams` (entry [0, 2), ``b`` [2, 3), ``c`` [3, 4)); a prompt that
repeats itself, so prompt lookup has drafts and the tiny model's greedy output, which falls
into a loop, keeps many of them.
"""

from __future__ import annotations

import pytest
import torch

from meshnet.gateway.pipeline import GenerationStats
from meshnet.gateway.speculation import PromptLookup
from meshnet.protocol.openai import SamplingParams

from test_hop_streams import MODEL, nodes, orchestrator, routes_over, sessions_left  # noqa: F401 (a fixture)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6, 7]
#: a prompt whose greedy output (52 repeated, then 284 repeated) has drafts rejected where it changes
REJECTING = [45, 52, 7, 13, 51, 40] * 4 + [45, 52]


def monolithic(tiny_hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    model = tiny_hf_model(MODEL)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


async def run(orch, prompt, params) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    return [t async for t in orch.generate(prompt, params, stats)], stats


@pytest.mark.parametrize("speculate", [None, 1, 4, 16])
@pytest.mark.parametrize("chain", [True, False])
async def test_greedy_tokens_with_drafts_equal_plain_decoding(nodes, tiny_hf_model, speculate, chain):
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"]), chain=chain, speculate=speculate)
    got, stats = await run(orch, PROMPT, SamplingParams(max_tokens=40))
    assert got == monolithic(tiny_hf_model, PROMPT, 40)
    assert stats.completion_tokens == 40
    # a fixed count drafts the same on both paths: (traversals, drafted, kept); auto's count follows timing
    fixed = {1: (20, 19, 19), 4: (9, 32, 30), 16: (4, 41, 35)}
    if speculate is None:
        assert stats.drafted > 0 and stats.accepted > 0  # drafts went down the chain and some were kept
    else:
        assert (stats.traversals, stats.drafted, stats.accepted) == fixed[speculate]
    assert stats.traversals + stats.accepted == 40 - 1  # the first token comes from the prefill
    assert stats.tokens_per_traversal > 1.0
    assert await sessions_left(nodes, ["b", "c"]) == {"b": 0, "c": 0}


async def test_off_sends_one_token_per_traversal(nodes, tiny_hf_model):
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=0)
    got, stats = await run(orch, PROMPT, SamplingParams(max_tokens=12))
    assert got == monolithic(tiny_hf_model, PROMPT, 12)
    assert (stats.traversals, stats.drafted, stats.accepted) == (11, 0, 0)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 13])
async def test_max_tokens_inside_an_accepted_run_ends_there(nodes, tiny_hf_model, max_tokens):
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=8)
    got, stats = await run(orch, PROMPT, SamplingParams(max_tokens=max_tokens))
    assert got == monolithic(tiny_hf_model, PROMPT, max_tokens)
    assert stats.finish_reason == "length" and stats.completion_tokens == max_tokens


async def test_every_hop_holds_exactly_the_kept_positions_after_each_step(nodes, tiny_hf_model):
    """After each step every cache (entry and hops) holds the step's position plus what it carried,
    and the next step's position is where the kept tokens end: the rejected drafts are gone."""
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=4)
    real_step, seen = orch._step, []

    async def step(session_id, remote, ids, position, local, rewind=False):
        out = await real_step(session_id, remote, ids, position, local, rewind)
        held = {name: [s.length for (sid, _), s in node.runtime.sessions._sessions.items()
                       if sid in (session_id, getattr(remote, "chain_id", None))]
                for name, (_, node) in nodes.items() if name != "c2"}
        seen.append((position, len(ids), held))
        return out

    orch._step = step
    got, stats = await run(orch, REJECTING, SamplingParams(max_tokens=30))
    assert got == monolithic(tiny_hf_model, REJECTING, 30)
    assert stats.accepted < stats.drafted
    decode = seen[-stats.traversals:]
    for position, fed, held in decode:
        assert held == {"entry": [position + fed], "b": [position + fed], "c": [position + fed]}
    # the next step starts where the kept tokens end: its position minus the last one's is 1 + kept
    starts = [p for p, _, _ in decode]
    kept_before_last = sum(b - a - 1 for a, b in zip(starts, starts[1:]))
    assert 0 <= stats.accepted - kept_before_last <= decode[-1][1] - 1
    assert any(fed > b - a for (a, fed, _), (b, _, _) in zip(decode, decode[1:]))  # some drafts were rejected


async def test_a_seeded_sampled_run_with_drafts_equals_plain_sampling(nodes):
    """With a one-hot draft, keeping a draft exactly when the sampled token equals it is the
    speculative sampling rule: the seeded generator draws the same values as plain decoding."""
    params = SamplingParams(max_tokens=30, temperature=0.7, seed=11, top_logprobs=2)
    spec, spec_stats = await run(orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=4), PROMPT, params)
    plain, plain_stats = await run(orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=0), PROMPT, params)
    assert spec == plain and spec_stats.drafted > 0
    assert [(lp.token_id, round(lp.logprob, 4)) for lp in spec_stats.logprobs] == \
        [(lp.token_id, round(lp.logprob, 4)) for lp in plain_stats.logprobs]


async def test_penalties_and_logit_bias_behave_as_without_drafts(nodes):
    params = SamplingParams(max_tokens=24, frequency_penalty=0.4, presence_penalty=0.3, logit_bias=((9, 3.0),))
    spec, stats = await run(orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=4), PROMPT, params)
    plain, _ = await run(orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=0), PROMPT, params)
    assert spec == plain and stats.drafted > 0


@pytest.mark.parametrize("oracle", [True, False])
async def test_an_end_token_inside_a_step_ends_the_generation_there(nodes, tiny_hf_model, monkeypatch, oracle):
    """The answer to :data:`REJECTING` is 52 seventeen times, then 284, made the end token here:
    drafted by an oracle (the end token is itself a kept draft) or by prompt lookup (it is the pick
    where the drafted 52 is rejected), the generation stops at it with finish reason ``stop``."""
    want = monolithic(tiny_hf_model, REJECTING, 30)
    end = want.index(284)
    orch = orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=6)
    monkeypatch.setattr(orch.entry, "eos_ids", frozenset({284}))
    monkeypatch.setattr(orch, "eos_ids", frozenset({284}))
    if oracle:
        monkeypatch.setattr(PromptLookup, "propose",
                            lambda self, limit: want[len(self.tokens) - len(REJECTING):][:limit])
    got, stats = await run(orch, REJECTING, SamplingParams(max_tokens=30))
    assert got == want[:end] and stats.finish_reason == "stop"
    assert stats.drafted > 0


async def test_speculative_steps_of_concurrent_sessions_run_as_one_batch(nodes, tiny_hf_model):
    """Two sessions drafting at once: their steps of several positions meet in the hops' batchers and
    run as one packed forward (ADR-0058), and each session's tokens are its plain ones."""
    import asyncio

    b = nodes["b"][1].runtime
    before = len(b.batch_sizes)
    orchs = [orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=4) for _ in range(2)]
    prompts = [PROMPT, REJECTING]
    results = await asyncio.gather(*(run(o, p, SamplingParams(max_tokens=40)) for o, p in zip(orchs, prompts)))
    for (got, stats), prompt in zip(results, prompts):
        assert got == monolithic(tiny_hf_model, prompt, 40) and stats.accepted > 0
    assert max(size for _, size in list(b.batch_sizes)[before:]) == 2


async def test_sampled_token_frequencies_over_many_seeds_are_those_of_plain_sampling(nodes):
    """Temperature 1 over 30 seeds, drafts on and off: each seed's tokens are the same (so the
    frequencies of every token are equal: the bound is zero), a seed's run is reproducible, and
    the samples are not degenerate."""
    from collections import Counter

    counts = {}
    for speculate in (4, 0):
        orch = orchestrator(nodes, routes_over(nodes, ["b", "c"]), speculate=speculate)
        runs = [await run(orch, REJECTING, SamplingParams(max_tokens=10, temperature=1.0, seed=seed))
                for seed in range(30)]
        counts[speculate] = Counter(t for got, _ in runs for t in got)
        if speculate:
            assert sum(stats.drafted for _, stats in runs) > 0
            again, _ = await run(orch, REJECTING, SamplingParams(max_tokens=10, temperature=1.0, seed=7))
            assert again == runs[7][0]
    assert counts[4] == counts[0] and len(counts[0]) > 20
