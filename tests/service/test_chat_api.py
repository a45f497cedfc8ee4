"""The OpenAI chat surface through the real node (and tracker) apps with tiny-llama weights.

Every accepted parameter works as OpenAI documents it (checked against the unsplit
transformers model), every other one is a 400 naming it; model aliases resolve to one
name; CPU work never blocks the event loop; oversized bodies are 413.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from tests.fake_nodes import HealthyNodes
from tests.payloads import SignAsNodes, capability_report, registration
from meshnet.node.entry import LocalEntry
from meshnet.node.entry import TokenPicker
from meshnet.layers import LayerRange
from meshnet.node.app import build_app
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings
from meshnet.tracker.app import build_app as build_tracker
from meshnet.tracker.service import TrackerSettings

MODEL = "tiny-llama"
SETTINGS = NodeSettings(node_id="node-entry", port=8800, wire_dtype="float32")
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello mesh"}], "max_tokens": 8,
        "temperature": 0}
URL = "/v1/chat/completions"


@pytest.fixture(scope="module")
def runtime(tiny_model_path) -> NodeRuntime:
    rt = NodeRuntime(max_loaded_shards=1, compute_dtype="float32")
    rt.load(MODEL, tiny_model_path(MODEL), LayerRange(0, 4))
    return rt


@pytest.fixture
async def entry(asgi_client, runtime):
    return await asgi_client(build_app(SETTINGS, runtime=runtime), "http://node-entry")


@pytest.fixture(scope="module")
def tokenizer(runtime):
    return runtime.slots[f"{MODEL}:0-4"].shard.tokenizer


def envelope(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["code"] == code and error["message"]
    return error


def reference(hf_model, tokenizer, messages, max_tokens: int, *, frequency: float = 0.0,
              presence: float = 0.0, bias: dict[int, float] | None = None):
    """Greedy continuation of the unsplit model with OpenAI's penalties and bias applied by
    hand; returns (ids, log-softmax rows of the adjusted logits)."""
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    counts = torch.zeros(hf_model.config.vocab_size)
    out, rows = [], []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
            logits = logits - counts * frequency - (counts > 0).float() * presence
            for token, b in (bias or {}).items():
                logits[token] += b
            token = int(torch.argmax(logits))
            if token == tokenizer.eos_token_id:
                break
            counts[token] += 1
            out.append(token)
            rows.append(torch.log_softmax(logits.double(), -1))
            ids.append(token)
    return out, rows


def sse_chunks(resp) -> list[dict]:
    events = [e for e in resp.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


# ---- refused parameters ---------------------------------------------------------------------


@pytest.mark.parametrize("fields, code, param", [
    ({"stop": [""]}, "invalid_field", "stop"),
    ({"seed": 2**64}, "invalid_field", "seed"),
    ({"n": 129}, "invalid_field", "n"),
    ({"logit_bias": {"512": 1}}, "invalid_field", "logit_bias"),  # tiny-llama's vocabulary is 0..511
    ({"response_format": {"type": "yaml"}}, "invalid_field", "response_format.type"),
    ({"tool_choice": "required"}, "invalid_field", "tool_choice"),  # no tools to call
    ({"frobnicate": 1}, "unsupported_parameter", "frobnicate"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_parameter_is_a_400_naming_it_also_for_streams(entry, fields, code, param, stream):
    resp = await entry.post(URL, json={**CHAT, **fields, "stream": stream})
    error = envelope(resp, 400, code)
    assert error["param"] == param and f"'{param}'" in error["message"]


async def test_the_seed_error_gives_the_range(entry):
    error = envelope(await entry.post(URL, json={**CHAT, "seed": 2**64}), 400, "invalid_field")
    assert "[0, 2**63 - 1]" in error["message"]
    assert (await entry.post(URL, json={**CHAT, "seed": 2**63 - 1, "temperature": 1})).status_code == 200


# ---- penalties, bias, logprobs, n ---------------------------------------------------------------


@pytest.mark.parametrize("fields, kw", [
    ({}, {}),
    ({"frequency_penalty": 2.0}, {"frequency": 2.0}),
    ({"presence_penalty": 2.0}, {"presence": 2.0}),
    ({"frequency_penalty": -1.0, "presence_penalty": 0.5}, {"frequency": -1.0, "presence": 0.5}),
    ({"logit_bias": {"65": 6.0, "66": -100}}, {"bias": {65: 6.0, 66: -100.0}}),
])
async def test_penalties_and_bias_match_the_openai_formula_on_the_model(entry, tokenizer, tiny_hf_model, fields, kw):
    body = (await entry.post(URL, json={**CHAT, "max_tokens": 12, **fields})).json()
    expected, _ = reference(tiny_hf_model(MODEL), tokenizer, CHAT["messages"], 12, **kw)
    assert body["meshnet"]["completion_token_ids"] == expected


async def test_a_frequency_penalty_changes_the_text(entry):
    plain = (await entry.post(URL, json={**CHAT, "max_tokens": 12})).json()
    penalised = (await entry.post(URL, json={**CHAT, "max_tokens": 12, "frequency_penalty": 2.0})).json()
    ids = plain["meshnet"]["completion_token_ids"]
    assert len(set(ids)) < len(ids)  # greedy repeats itself on this model ...
    assert penalised["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]  # ... not so


async def test_logprobs_are_the_models_log_softmax_in_openai_shape(entry, tokenizer, tiny_hf_model):
    resp = await entry.post(URL, json={**CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
                                       "presence_penalty": 1.0})
    choice = resp.json()["choices"][0]
    ids, rows = reference(tiny_hf_model(MODEL), tokenizer, CHAT["messages"], 4, presence=1.0)
    content = choice["logprobs"]["content"]
    assert len(content) == len(ids) == 4
    for entry_, token, row in zip(content, ids, rows):
        assert entry_["token"] == tokenizer.decode([token])
        assert entry_["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        top = entry_["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry_["token"]  # greedy: the chosen token is the best
        assert [t["logprob"] for t in top] == pytest.approx([float(v) for v in row.topk(3).values], abs=1e-4)
    # bytes are exact even for tokens holding part of a character: together they are the text
    all_bytes = bytes(b for e in content for b in e["bytes"])
    assert all_bytes.decode("utf-8", errors="replace") == tokenizer.decode(ids)
    plain = (await entry.post(URL, json={**CHAT, "max_tokens": 4})).json()["choices"][0]
    assert plain["logprobs"] is None


async def test_n_choices_are_seeded_generations_of_their_own(entry):
    body = {**CHAT, "temperature": 1.0, "seed": 11, "max_tokens": 6}
    many = (await entry.post(URL, json={**body, "n": 3})).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    singles = [(await entry.post(URL, json={**body, "seed": 11 + i})).json() for i in range(3)]
    assert [c["message"]["content"] for c in many["choices"]] == \
        [s["choices"][0]["message"]["content"] for s in singles]
    assert many["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert len(many["meshnet"]["choices"]) == 3


async def test_up_to_128_choices_run_in_waves_and_each_is_its_own_seeded_generation(entry):
    from meshnet.gateway.openai_api import CHOICES_AT_ONCE
    body = {**CHAT, "temperature": 1.0, "seed": 5, "max_tokens": 3}
    many = (await entry.post(URL, json={**body, "n": 20})).json()
    assert 20 > CHOICES_AT_ONCE and [c["index"] for c in many["choices"]] == list(range(20))
    for i in (0, 9, 19):  # choice i is the request seeded seed + i, whichever wave ran it
        single = (await entry.post(URL, json={**body, "seed": 5 + i})).json()["choices"][0]
        assert many["choices"][i]["message"]["content"] == single["message"]["content"]
    assert len(many["meshnet"]["choices"]) == 20


def assert_same_logprobs(got: list[dict], want: list[dict]) -> None:
    """Same tokens, bytes and top alternatives; log-probabilities equal up to float rounding. The
    n choices of a request run concurrently, and the node batches their steps in whatever groups
    they meet (ADR-0041): a matmul over 2 rows rounds its last bits differently from one over 1."""
    def exact(entries):
        return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in entries]

    def values(entries):
        return [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
    assert exact(got) == exact(want)
    assert values(got) == pytest.approx(values(want), abs=1e-4)


async def test_stream_carries_n_choices_logprobs_and_the_usage_chunk(entry):
    body = {**CHAT, "temperature": 1.0, "seed": 5, "max_tokens": 6, "n": 2, "logprobs": True, "top_logprobs": 2}
    plain = (await entry.post(URL, json=body)).json()
    resp = await entry.post(URL, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_chunks(resp)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])  # one usage in the stream: summing counts it once
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == plain["choices"][i]["message"]["content"]
        streamed = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert_same_logprobs(streamed, plain["choices"][i]["logprobs"]["content"])
        assert mine[-1]["finish_reason"] == plain["choices"][i]["finish_reason"]


async def test_a_failure_mid_stream_is_an_error_event_not_a_dropped_connection(entry, monkeypatch):
    real, calls = TokenPicker.pick, []

    def flaky(self, logits):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("boom")
        return real(self, logits)

    monkeypatch.setattr(TokenPicker, "pick", flaky)
    resp = await entry.post(URL, json={**CHAT, "stream": True})
    last = json.loads([e for e in resp.text.split("\n\n") if e][-1].removeprefix("data: "))
    assert last["error"]["type"] == "server_error" and "boom" in last["error"]["message"]


# ---- model names ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["meshnet/tiny-llama", "MESHNET/Tiny-Llama", "TINY-LLAMA"])
async def test_an_alias_reaches_the_entry_shard_under_the_canonical_name(entry, name):
    resp = await entry.post(URL, json={**CHAT, "model": name, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == MODEL


async def test_the_tracker_resolves_aliases_like_the_nodes(asgi_client, entry):
    app = build_tracker(TrackerSettings(models=(MODEL,), db_path=":memory:"), run_loop=False,
                        transport=HealthyNodes())
    tracker = await asgi_client(app, "http://tracker", auth=SignAsNodes())
    report = capability_report("meshnet/tiny-llama", 0, 3)
    shard = {"model": "meshnet/tiny-llama", "shard_start": 0, "shard_end": 3, "entry": True, "report": report}
    resp = await tracker.post("/v1/nodes/register", json=registration("node-entry", "http://node-entry",
                                                                       shards=[shard]))
    assert resp.status_code == 200, resp.text
    app.state.http = entry  # the tracker's forwards reach the in-process entry node
    coverage = (await tracker.get("/v1/coverage")).json()["models"]
    assert [(c["model"], c["routable"]) for c in coverage] == [(MODEL, True)]
    assert (await tracker.get("/v1/coverage/Meshnet/Tiny-Llama")).json() == coverage[0]  # an alias with a slash
    route = (await tracker.get("/v1/route", params={"model": "Meshnet/Tiny-Llama"})).json()
    assert route["model"] == MODEL and len(route["hops"]) == 1
    resp = await tracker.post(URL, json={**CHAT, "model": "MESHNET/TINY-LLAMA", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == MODEL
    metrics = (await tracker.get("/metrics")).text
    assert f'meshnet_tracker_chat_requests_total{{model="{MODEL}"}} 1.0' in metrics
    assert "MESHNET" not in metrics


# ---- the event loop and body sizes -------------------------------------------------------------------


async def test_health_answers_while_a_prompt_is_being_tokenized(entry, monkeypatch):
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    real = LocalEntry.encode_chat

    def slow(self, messages, tools=None):
        started.set()
        release.wait(5)  # on the event loop this would block the health request below
        finished.set()
        return real(self, messages, tools)

    monkeypatch.setattr(LocalEntry, "encode_chat", slow)
    chat = asyncio.create_task(entry.post(URL, json={**CHAT, "max_tokens": 2}))
    for _ in range(2000):  # bounded: 10 s
        if started.is_set() or chat.done():
            break
        await asyncio.sleep(0.005)
    assert started.is_set(), "tokenization never started"
    health = await entry.get("/v1/health")
    assert health.status_code == 200
    assert not finished.is_set()  # health answered while the prompt was still being tokenized
    release.set()
    assert (await chat).status_code == 200


async def test_a_huge_prompt_is_refused_without_tokenizing_it(entry, monkeypatch):
    calls = []
    monkeypatch.setattr(LocalEntry, "encode_chat", lambda self, messages, tools=None: calls.append(1))
    huge = {**CHAT, "messages": [{"role": "user", "content": "hello world, " * 200000}]}  # 2.6 MB
    for stream in (False, True):
        error = envelope(await entry.post(URL, json={**huge, "stream": stream}), 400, "context_length_exceeded")
        assert "1024 tokens" in error["message"]
    assert calls == []


async def test_a_body_over_the_limit_is_413(asgi_client, runtime):
    from dataclasses import replace

    node = await asgi_client(build_app(replace(SETTINGS, max_body_bytes=4096), runtime=runtime), "http://node")
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    error = envelope(await node.post(URL, json=big), 413, "payload_too_large")
    assert "4096" in error["message"]

    async def chunked():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b" " * 1000

    envelope(await node.post(URL, content=chunked(), headers={"Content-Type": "application/json"}),
             413, "payload_too_large")
    assert (await node.post(URL, json=CHAT)).status_code == 200
    # activation frames are bounded by the wire format's limit, not the JSON one
    from meshnet.node import wire

    frame = wire.encode(torch.zeros(1, 20, 64), dtype="float32", compress=False)
    assert len(frame) > 4096
    resp = await node.post("/v1/forward", content=frame, headers={
        "X-Meshnet-Session": "s-413", "X-Meshnet-Start-Layer": "2", "X-Meshnet-End-Layer": "3"})
    assert resp.status_code == 200, resp.text
    tracker = await asgi_client(build_tracker(TrackerSettings(models=(MODEL,), max_body_bytes=4096), run_loop=False))
    envelope(await tracker.post(URL, json=big), 413, "payload_too_large")
    envelope(await tracker.post("/v1/nodes/register", content=b"{" + b" " * 5000 + b"}",
                                headers={"Content-Type": "application/json"}), 413, "payload_too_large")
