"""``POST /v1/completions`` (meshnet.gateway.completions) at an entry node in-process (tiny-llama,
the whole model on one node) and through a tracker that serves layers itself."""

from __future__ import annotations

import json

import pytest
import torch


MODEL = "tiny-llama"
URL = "/v1/completions"


@pytest.fixture
def entry(whole_tiny_entry):
    return whole_tiny_entry


def generate(tiny_model_path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(MODEL), dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


async def test_token_id_prompts_give_generates_greedy_tokens_and_openai_shapes(entry, tiny_model_path):
    ids = [[40, 41, 42, 43, 44], [100, 7, 8]]
    resp = await entry.post(URL, json={"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0, "n": 2})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    tokens = body["meshnet"]["choices"]
    for p, prompt in enumerate(ids):
        want = generate(tiny_model_path, prompt, 6)
        want = want[:want.index(2)] if 2 in want else want  # the end token ends a choice, unsent
        assert tokens[2 * p]["completion_token_ids"] == tokens[2 * p + 1]["completion_token_ids"] == want
    assert body["usage"]["prompt_tokens"] == 8
    assert body["usage"]["completion_tokens"] == sum(len(t["completion_token_ids"]) for t in tokens)


async def test_echo_logprobs_and_scoring_with_no_new_tokens(entry):
    scored = (await entry.post(URL, json={"model": MODEL, "prompt": "abc", "max_tokens": 0, "echo": True})).json()
    assert [(c["text"], c["finish_reason"]) for c in scored["choices"]] == [("abc", "length")]
    assert scored["usage"]["completion_tokens"] == 0
    body = (await entry.post(URL, json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0,
                                        "echo": True})).json()
    assert body["choices"][0]["text"].startswith("abc")
    lp = (await entry.post(URL, json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0,
                                      "logprobs": 2})).json()["choices"][0]["logprobs"]
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) > 0
    assert all(len(top) <= 2 and v <= 0 for top, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0


async def test_a_stream_gives_the_same_text_and_one_usage(entry):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    plain = (await entry.post(URL, json=body)).json()
    resp = await entry.post(URL, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("fields, code, param", [
    ({"prompt": "x", "suffix": "y"}, "unsupported_parameter", "suffix"),
    ({"prompt": "x", "max_tokens": 0}, "invalid_field", "max_tokens"),
    ({"prompt": "x", "best_of": 3}, "invalid_field", "best_of"),
    ({"prompt": []}, "invalid_field", "prompt"),
    ({"prompt": [1, 2, 99999]}, "invalid_field", "prompt"),
    ({"prompt": "x", "logprobs": 6}, "invalid_field", "logprobs"),
    ({"prompt": "x", "max_tokens": True}, "invalid_field", "max_tokens"),
    ({"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 8192}, "invalid_field", "max_tokens"),  # 49,152 tokens
])
async def test_bad_requests_are_400_naming_the_field(entry, fields, code, param):
    resp = await entry.post(URL, json={"model": MODEL, **fields})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == (code, param)


def reference_scores(tiny_model_path, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """transformers' own float32 log-softmax over the unsplit model: each token's log-probability
    given the ones before it (from the second token on) and the ``top`` best ids and values."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(MODEL), dtype=torch.float32).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    out = []
    for i, token in enumerate(ids[1:]):
        values, best = torch.sort(logp[i], descending=True, stable=True)
        out.append((float(logp[i, token]), [(int(b), float(v)) for b, v in zip(best[:top], values[:top])]))
    return out


async def test_echo_with_logprobs_scores_every_prompt_token_as_the_unsplit_model_does(entry, tiny_model_path):
    ids = [1, 306, 466, 304, 174, 92, 278, 318, 289, 13, 5, 99, 7, 250]
    body = (await entry.post(URL, json={"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True,
                                        "logprobs": 2})).json()
    assert "choices" in body, body
    [choice] = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI: nothing precedes it
    want = reference_scores(tiny_model_path, ids, 2)
    assert max(abs(got - w) for got, (w, _) in zip(lp["token_logprobs"][1:], want)) < 1e-4
    # keyed by text, as OpenAI does: two best tokens with one text (bytes of one character) count once
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert (choice["finish_reason"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (
        "length", len(ids), 0)
    # with new tokens too: the prompt's entries, then the completion's
    more = (await entry.post(URL, json={"model": MODEL, "prompt": ids, "max_tokens": 3, "echo": True,
                                        "logprobs": 1, "temperature": 0})).json()["choices"][0]["logprobs"]
    assert more["token_logprobs"][1:len(ids)] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    assert len(more["tokens"]) == len(ids) + 3 and more["token_logprobs"][0] is None


async def test_a_prompt_scored_across_a_remote_hop_equals_the_unsplit_model(tiny_model_path):
    """The orchestrator's scoring prefill brings every position back from the last hop (the entry
    holds layers [0, 2), node c [2, 4)), in chunks smaller than the prompt."""
    import httpx
    from asgi_lifespan import LifespanManager

    from meshnet.dataplane.chain import ChainEnd
    from meshnet.dataplane.failover import MeshLink
    from meshnet.gateway.pipeline import Orchestrator, OrchestratorSettings
    from meshnet.layers import LayerRange
    from meshnet.node.app import build_app
    from meshnet.node.entry import LocalEntry
    from meshnet.node.runtime import NodeRuntime
    from meshnet.node.settings import NodeSettings
    from meshnet.protocol.route import Hop, Route as MeshRoute

    path = tiny_model_path(MODEL)
    first, second = NodeRuntime(compute_dtype="float32"), NodeRuntime(compute_dtype="float32")
    first.load(MODEL, path, LayerRange(0, 2))
    second.load(MODEL, path, LayerRange(2, 4))
    app = build_app(NodeSettings(node_id="c", port=1, wire_dtype="float32"), runtime=second)
    ids = list(range(3, 40, 2))

    async def routes(model, layers, exclude, session_id):
        return MeshRoute([Hop("c", "http://c", layers)])

    async def report(node_id, reason, ticket=None):
        raise AssertionError(f"no hop fails here: {node_id} {reason}")

    async with LifespanManager(app):
        async with httpx.AsyncClient(mounts={"http://c": httpx.ASGITransport(app=app)}) as client:
            slot = next(iter(first.slots.values()))
            orch = Orchestrator(LocalEntry(first, slot, wire_dtype="float32"), end=ChainEnd("entry", "http://entry"),
                                link=MeshLink(client, routes, report), settings=OrchestratorSettings(chunk_tokens=8))
            scores = await orch.score(ids, top=3)
    assert scores[0] is None and len(scores) == len(ids)
    want = reference_scores(tiny_model_path, ids, 3)
    assert [s.token_id for s in scores[1:]] == ids[1:]
    assert max(abs(s.logprob - w) for s, (w, _) in zip(scores[1:], want)) < 1e-4
    assert [[t for t, _ in s.top] for s in scores[1:]] == [[t for t, _ in top] for _, top in want]
    assert len(first.sessions) == 0


async def test_a_streamed_echo_carries_the_prompt_logprobs_on_its_first_chunk(entry):
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    plain = (await entry.post(URL, json=body)).json()["choices"][0]["logprobs"]
    streamed = (await entry.post(URL, json={**body, "stream": True})).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) == 4
    assert first["token_logprobs"][1:] == pytest.approx(plain["token_logprobs"][1:4], abs=1e-6)
