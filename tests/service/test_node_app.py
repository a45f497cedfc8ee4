"""Node service (meshnet.node.app) in-process: forward, sessions, health, chat and metrics.

A real NodeRuntime with tiny-llama weights, no tracker: ``tail`` holds layers [2,4),
``entry`` holds the whole model [0,4) (embeddings, head, tokenizer).
"""

from __future__ import annotations

import time

import json
import struct
import uuid

import pytest
import torch
import zstandard
from torch.testing import assert_close

from meshnet.node import wire
from meshnet.layers import LayerRange
from meshnet.models.caches import KVCache
from meshnet.node.app import build_app
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings

MODEL = "tiny-llama"
HIDDEN = 64
ENTRY_SETTINGS = NodeSettings(node_id="node-entry", port=8800, wire_dtype="float32")
TAIL_SETTINGS = NodeSettings(node_id="node-tail", port=8801, wire_dtype="float32")


@pytest.fixture(scope="module")
def tail_runtime(tiny_model_path) -> NodeRuntime:
    runtime = NodeRuntime(max_loaded_shards=1, compute_dtype="float32")
    runtime.load(MODEL, tiny_model_path(MODEL), LayerRange(2, 4))
    return runtime


@pytest.fixture(scope="module")
def entry_runtime(tiny_model_path) -> NodeRuntime:
    runtime = NodeRuntime(max_loaded_shards=1, compute_dtype="float32")
    runtime.load(MODEL, tiny_model_path(MODEL), LayerRange(0, 4))
    return runtime


@pytest.fixture
async def tail(asgi_client, tail_runtime):
    return await asgi_client(build_app(TAIL_SETTINGS, runtime=tail_runtime), "http://node-tail")


@pytest.fixture
async def entry(asgi_client, entry_runtime):
    return await asgi_client(build_app(ENTRY_SETTINGS, runtime=entry_runtime), "http://node-entry")


@pytest.fixture(scope="module")
def zstd_bomb() -> bytes:
    """A valid float32 frame header announcing just over 256 MiB of zeros, zstd-compressed to ~8 KiB."""
    positions = wire.DEFAULT_MAX_BYTES // (HIDDEN * 4) + 1
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    parts = [compressor.compress(struct.pack("<4sBBBB3I", wire.MAGIC, 1, 2, 3, 0, 1, positions, HIDDEN))]
    zeros, left = bytes(1 << 20), positions * HIDDEN * 4
    while left:
        parts.append(compressor.compress(zeros[:min(left, len(zeros))]))
        left -= min(left, len(zeros))
    parts.append(compressor.flush())
    return b"".join(parts)


def hidden_states(seq: int, seed: int = 0, width: int = HIDDEN) -> torch.Tensor:
    return torch.randn(1, seq, width, generator=torch.Generator().manual_seed(seed))


def fwd_headers(session: str, start: int = 2, end: int = 3, position: int = 0, **extra: str) -> dict:
    """Forward headers; ``start``/``end`` are inclusive as on the wire (ADR-0002)."""
    return {"X-Meshnet-Session": session, "X-Meshnet-Start-Layer": str(start),
            "X-Meshnet-End-Layer": str(end), "X-Meshnet-Position": str(position), **extra}


async def post_forward(client, body: bytes | torch.Tensor, headers: dict):
    if isinstance(body, torch.Tensor):
        body = wire.encode(body, dtype="float32")
    return await client.post("/v1/forward", content=body, headers=headers)


def assert_envelope(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert {"message", "type", "code"} <= set(error)
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    return error


def new_session() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


async def assert_good_forward(client, runtime: NodeRuntime) -> None:
    """A fresh session's 5-token forward over layers 2-3 equals ShardModel.forward."""
    hidden = hidden_states(5, seed=99)
    resp = await post_forward(client, hidden, fwd_headers(new_session()))
    assert resp.status_code == 200, resp.text
    shard = runtime.find_slot(MODEL, LayerRange(2, 4)).shard
    assert_close(wire.decode(resp.content), shard.forward(hidden, KVCache(), 0, LayerRange(2, 4)))


# ---- forward ---------------------------------------------------------------------------


async def test_forward_equals_shard_forward(tail, tail_runtime):
    hidden = hidden_states(6, seed=1)
    resp = await post_forward(tail, hidden, fwd_headers(new_session()))
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/octet-stream"
    out = wire.decode(resp.content)
    assert out.dtype == torch.float32 and out.shape == (1, 6, HIDDEN)
    shard = tail_runtime.slots[f"{MODEL}:2-4"].shard
    assert_close(out, shard.forward(hidden, KVCache(), 0))


async def test_prefill_then_decode_keeps_the_session_cache(tail, tail_runtime):
    session, hidden = new_session(), hidden_states(7, seed=2)
    shard = tail_runtime.slots[f"{MODEL}:2-4"].shard
    cache = KVCache()
    expected_prefill = shard.forward(hidden[:, :6], cache, 0)
    expected_step = shard.forward(hidden[:, 6:], cache, 6)
    resp = await post_forward(tail, hidden[:, :6], fwd_headers(session, position=0))
    assert_close(wire.decode(resp.content), expected_prefill)
    resp = await post_forward(tail, hidden[:, 6:], fwd_headers(session, position=6))
    assert resp.status_code == 200, resp.text
    assert_close(wire.decode(resp.content), expected_step)


async def test_last_only_returns_one_position(tail, tail_runtime):
    hidden = hidden_states(6, seed=3)
    resp = await post_forward(tail, hidden, fwd_headers(new_session(), **{"X-Meshnet-Last-Only": "1"}))
    assert resp.status_code == 200, resp.text
    out = wire.decode(resp.content)
    assert out.shape == (1, 1, HIDDEN)
    shard = tail_runtime.slots[f"{MODEL}:2-4"].shard
    assert_close(out, shard.forward(hidden, KVCache(), 0)[:, -1:])


async def test_bfloat16_frame_gets_a_bfloat16_answer(tail):
    body = wire.encode(hidden_states(3, seed=4), dtype="bfloat16")
    resp = await post_forward(tail, body, fwd_headers(new_session()))
    assert resp.status_code == 200, resp.text
    out = wire.decode(resp.content)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 3, HIDDEN)


async def test_hop_may_start_inside_the_shard(entry, entry_runtime):
    """ADR-0012: an entry node holding [0,4) serves a hop for layers 2-3 only."""
    hidden = hidden_states(4, seed=5)
    resp = await post_forward(entry, hidden, fwd_headers(new_session(), start=2, end=3))
    assert resp.status_code == 200, resp.text
    shard = entry_runtime.slots[f"{MODEL}:0-4"].shard
    assert_close(wire.decode(resp.content), shard.forward(hidden, KVCache(), 0, LayerRange(2, 4)))


def _frame(seq: int, code: int = 2, width: int = HIDDEN, payload_bytes: int | None = None,
           magic: bytes = wire.MAGIC) -> bytes:
    header = struct.pack("<4sBBBB3I", magic, 1, code, 3, 0, 1, seq, width)
    return header + bytes(seq * width * 4 if payload_bytes is None else payload_bytes)


def _nan_frame() -> bytes:
    hidden = hidden_states(3, seed=6)
    hidden[0, 1, 5] = float("nan")
    return wire.encode(hidden, dtype="float32")


BAD_FORWARDS = {
    # case id: (body, header overrides (None value removes the header), status, code)
    "truncated": (lambda: _frame(3)[:6], {}, 400, "invalid_activation"),
    "wrong-magic": (lambda: _frame(3, magic=b"JUNK"), {}, 400, "invalid_activation"),
    "unknown-dtype": (lambda: _frame(3, code=9), {}, 400, "invalid_activation"),
    "shape-mismatch": (lambda: _frame(3, payload_bytes=2 * HIDDEN * 4), {}, 400, "invalid_activation"),
    "nan": (_nan_frame, {}, 400, "invalid_activation"),
    "missing-session": (lambda: _frame(3), {"X-Meshnet-Session": None}, 422, "invalid_field"),
    "missing-start-layer": (lambda: _frame(3), {"X-Meshnet-Start-Layer": None}, 422, "invalid_field"),
    "missing-end-layer": (lambda: _frame(3), {"X-Meshnet-End-Layer": None}, 422, "invalid_field"),
    "non-integer-position": (lambda: _frame(3), {"X-Meshnet-Position": "three"}, 422, "invalid_field"),
    "non-integer-layer": (lambda: _frame(3), {"X-Meshnet-Start-Layer": "2.5"}, 422, "invalid_field"),
    "negative-position": (lambda: _frame(3), {"X-Meshnet-Position": "-1"}, 422, "invalid_field"),
    "end-before-start": (lambda: _frame(3), {"X-Meshnet-Start-Layer": "3", "X-Meshnet-End-Layer": "2"},
                         422, "invalid_field"),
    "wrong-hidden-size": (lambda: _frame(3, width=32), {}, 400, "invalid_request"),
    "rank-2-hidden": (lambda: wire.encode(torch.zeros(3, HIDDEN), dtype="float32"), {}, 400, "invalid_request"),
    "layers-not-held": (lambda: _frame(3), {"X-Meshnet-Start-Layer": "0", "X-Meshnet-End-Layer": "1"},
                        404, "shard_not_loaded"),
    "layers-beyond-shard": (lambda: _frame(3), {"X-Meshnet-End-Layer": "4"}, 404, "shard_not_loaded"),
    "other-model": (lambda: _frame(3), {"X-Meshnet-Model": "tiny-gpt2"}, 404, "shard_not_loaded"),
    "wrong-position": (lambda: _frame(3), {"X-Meshnet-Position": "5"}, 409, "session_conflict"),
}


@pytest.mark.parametrize("case", list(BAD_FORWARDS))
async def test_bad_forward_is_a_4xx_envelope_and_the_node_keeps_serving(case, tail, tail_runtime):
    make_body, overrides, status, code = BAD_FORWARDS[case]
    headers = fwd_headers(new_session())
    for name, value in overrides.items():
        if value is None:
            del headers[name]
        else:
            headers[name] = value
    resp = await post_forward(tail, make_body(), headers)
    assert_envelope(resp, status, code)
    await assert_good_forward(tail, tail_runtime)


async def test_oversized_decompression_is_413(tail, tail_runtime, zstd_bomb):
    assert len(zstd_bomb) < 64 * 1024
    resp = await post_forward(tail, zstd_bomb, fwd_headers(new_session()))
    error = assert_envelope(resp, 413, "payload_too_large")
    assert "268435456-byte limit" in error["message"]
    await assert_good_forward(tail, tail_runtime)


async def test_error_messages_say_what_is_wrong(tail):
    resp = await post_forward(tail, _frame(3, code=9), fwd_headers(new_session()))
    assert resp.json()["error"]["message"] == "unknown dtype code 9"
    headers = fwd_headers(new_session())
    del headers["X-Meshnet-End-Layer"]
    resp = await post_forward(tail, _frame(3), headers)
    assert resp.json()["error"]["message"] == "missing header X-Meshnet-End-Layer"
    resp = await post_forward(tail, _frame(3, width=32), fwd_headers(new_session()))
    assert resp.json()["error"]["message"] == "activation shape [1, 3, 32] does not match [1, seq >= 1, 64]"
    resp = await post_forward(tail, _frame(3), fwd_headers(new_session(), start=0, end=1))
    assert "no loaded shard serves layers 0-1" in resp.json()["error"]["message"]


async def test_empty_sequence_is_a_4xx(asgi_client, tail_runtime):
    client = await asgi_client(build_app(TAIL_SETTINGS, runtime=tail_runtime), raise_app_exceptions=False)
    resp = await post_forward(client, torch.zeros(1, 0, HIDDEN), fwd_headers(new_session()))
    assert_envelope(resp, 400, "invalid_request")


async def test_a_batch_other_than_one_is_a_4xx(asgi_client, tail_runtime):
    client = await asgi_client(build_app(TAIL_SETTINGS, runtime=tail_runtime), raise_app_exceptions=False)
    resp = await post_forward(client, torch.zeros(2, 3, HIDDEN), fwd_headers(new_session(), position=0))
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == f"activation shape [2, 3, {HIDDEN}] does not match [1, seq >= 1, {HIDDEN}]"


# ---- sessions, health, metrics ---------------------------------------------------------------


async def test_delete_session_releases_its_cache(tail):
    session = new_session()
    resp = await post_forward(tail, hidden_states(3), fwd_headers(session))
    assert resp.status_code == 200
    assert (await tail.delete(f"/v1/sessions/{session}")).json() == {"released": 1}
    assert (await tail.delete(f"/v1/sessions/{session}")).json() == {"released": 0}
    resp = await post_forward(tail, hidden_states(1), fwd_headers(session, position=3))
    assert_envelope(resp, 409, "session_conflict")


async def test_health(tail, tail_runtime):
    resp = await tail.get("/v1/health")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "ok"
    assert body["node_id"] == "node-tail" and body["endpoint"] == "http://127.0.0.1:8801"
    assert body["shards"] == [{"model": MODEL, "shard_start": 2, "shard_end": 3, "tier": "pinned",
                               "quantization": "bfloat16", "entry": False,
                               "weight_bytes": tail_runtime.slots[f"{MODEL}:2-4"].shard.weight_bytes(), "num_layers": 4}]
    assert body["slots_total"] == 1 and body["compute_dtype"] == "float32"
    assert body["sessions"] == len(tail_runtime.sessions)
    assert body["cache_bytes_left"] == tail_runtime.sessions.bytes_left


async def test_metrics_are_prometheus_text_with_meshnet_names(tail):
    resp = await post_forward(tail, hidden_states(3), fwd_headers(new_session()))
    assert resp.status_code == 200
    resp = await tail.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    lines = resp.text.splitlines()
    assert "meshnet_forward_tokens_total 3.0" in lines
    assert "meshnet_forward_seconds_count 1.0" in lines
    names = {line.split()[2] for line in lines if line.startswith("# TYPE")}
    assert {"meshnet_chat_requests_total", "meshnet_forward_tokens_total", "meshnet_sessions",
            "meshnet_cache_left_bytes", "meshnet_forward_seconds"} <= names
    assert all(name.startswith("meshnet_") for name in names)


# ---- OpenAI chat on the entry node -----------------------------------------------------------


def greedy_reference(hf_model, tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[int], list[int]]:
    """Prompt ids and greedy continuation (EOS excluded) from the unsplit transformers model."""
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_tokens):
            token = int(torch.argmax(hf_model(torch.tensor([ids])).logits[0, -1]))
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
            ids.append(token)
    return prompt, out


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello mesh"}], "max_tokens": 6,
        "temperature": 0}


async def test_chat_completion_matches_greedy_transformers(entry, entry_runtime, tiny_hf_model):
    tokenizer = entry_runtime.slots[f"{MODEL}:0-4"].shard.tokenizer
    prompt, generated = greedy_reference(tiny_hf_model(MODEL), tokenizer, CHAT["messages"], 6)
    sessions_before = len(entry_runtime.sessions)
    resp = await entry.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(generated, skip_special_tokens=True)
    assert choice["finish_reason"] == ("length" if len(generated) == 6 else "stop")
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(generated),
                             "total_tokens": len(prompt) + len(generated)}
    assert body["meshnet"]["route"] == [{"node_id": "node-entry", "endpoint": "http://127.0.0.1:8800",
                                         "start_layer": 0, "end_layer": 3}]
    assert body["meshnet"]["failovers"] == 0
    assert len(entry_runtime.sessions) == sessions_before  # the generation's session is released


async def test_chat_stream_is_sse_ending_with_done(entry):
    plain = (await entry.post("/v1/chat/completions", json=CHAT)).json()
    resp = await entry.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [e for e in resp.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == plain["choices"][0]["message"]["content"]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert "usage" not in last and all("usage" not in c for c in chunks)  # not asked for: none sent
    assert last["meshnet"]["route"] == plain["meshnet"]["route"]


async def test_seeded_sampling_is_reproducible_over_http(entry):
    body = {**CHAT, "temperature": 1.0, "seed": 1234, "max_tokens": 8}
    first = (await entry.post("/v1/chat/completions", json=body)).json()
    second = (await entry.post("/v1/chat/completions", json=body)).json()
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    assert first["usage"] == second["usage"]


@pytest.mark.parametrize("body, field", [
    ({"model": MODEL, "max_tokens": 4}, "messages"),
    ({**CHAT, "temperature": 5}, "temperature"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
])
async def test_bad_chat_body_is_400_naming_the_field(entry, body, field):
    """OpenAI answers every bad chat parameter with 400 (SDKs raise BadRequestError on it)."""
    resp = await entry.post("/v1/chat/completions", json=body)
    error = assert_envelope(resp, 400, "invalid_field")
    assert error["message"].startswith(f"invalid field '{field}'")
    assert error["type"] == "invalid_request_error"


async def test_chat_body_that_is_not_json_is_400(entry):
    resp = await entry.post("/v1/chat/completions", content=b"{nope", headers={"Content-Type": "application/json"})
    assert_envelope(resp, 400, "invalid_request")


async def test_chat_for_a_model_without_an_entry_shard_is_404(entry, tail):
    resp = await entry.post("/v1/chat/completions", json={**CHAT, "model": "tiny-gpt2"})
    assert_envelope(resp, 404, "model_not_found")
    resp = await tail.post("/v1/chat/completions", json=CHAT)
    assert_envelope(resp, 404, "model_not_found")


async def test_models_lists_entry_shards_only(entry, tail):
    data = (await entry.get("/v1/models")).json()["data"]
    assert abs(data[0].pop("created") - time.time()) < 3600
    assert data == [{"id": MODEL, "object": "model", "owned_by": "meshnet", "aliases": ["meshnet/tiny-llama"]}]
    assert (await tail.get("/v1/models")).json()["data"] == []


async def test_a_model_is_found_by_id_or_alias_and_an_unknown_one_is_404(entry, tail):
    listed = (await entry.get("/v1/models")).json()["data"][0]
    assert (await entry.get(f"/v1/models/{MODEL}")).json() == listed
    assert (await entry.get("/v1/models/meshnet/tiny-llama")).json() == listed  # an alias, slash and all
    assert_envelope(await tail.get(f"/v1/models/{MODEL}"), 404, "model_not_found")  # no entry shard there
    assert_envelope(await entry.get("/v1/models/nothing"), 404, "model_not_found")


async def test_chat_requests_are_counted_in_metrics(entry, entry_runtime):
    assert (await entry.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})).status_code == 200
    lines = (await entry.get("/metrics")).text.splitlines()
    assert "meshnet_chat_requests_total 1.0" in lines
    assert f"meshnet_sessions {float(len(entry_runtime.sessions))}" in lines


async def test_serving_metrics_follow_a_generation(entry):
    """Time to first token, time per output token, token totals and requests running."""
    resp = await entry.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "temperature": 0})
    usage = resp.json()["usage"]
    lines = (await entry.get("/metrics")).text.splitlines()
    assert "meshnet_time_to_first_token_seconds_count 1.0" in lines
    assert f"meshnet_prompt_tokens_total {float(usage['prompt_tokens'])}" in lines
    assert f"meshnet_generation_tokens_total {float(usage['completion_tokens'])}" in lines
    assert "meshnet_requests_running 0.0" in lines
    expected_tpot = "1.0" if usage["completion_tokens"] > 1 else "0.0"
    assert f"meshnet_time_per_output_token_seconds_count {expected_tpot}" in lines


async def test_text_parts_content_and_an_overlong_prompt(entry):
    parts = {**CHAT, "max_tokens": 2, "temperature": 0,
             "messages": [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]}
    plain = {**parts, "messages": [{"role": "user", "content": "hello"}]}
    a = (await entry.post("/v1/chat/completions", json=parts)).json()
    b = (await entry.post("/v1/chat/completions", json=plain)).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]
    too_long = {**plain, "messages": [{"role": "user", "content": "x" * 1100}]}  # tiny-llama: 1,024 positions
    for stream in (False, True):
        resp = await entry.post("/v1/chat/completions", json={**too_long, "stream": stream})
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "context_length_exceeded"


async def test_time_to_first_token_is_measured_to_the_first_streamed_token(entry):
    """The histogram observes arrival → first content chunk, which includes prefill (not prefill alone)."""
    body = {**CHAT, "max_tokens": 3, "temperature": 0, "stream": True}
    async with entry.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: {")]
    last = json.loads(events[-1])
    ttft, prefill = last["meshnet"]["time_to_first_token_s"], last["meshnet"]["prefill_s"]
    assert ttft is not None and ttft >= prefill > 0
    lines = (await entry.get("/metrics")).text.splitlines()
    assert "meshnet_time_to_first_token_seconds_count 1.0" in lines
    observed = float(next(x for x in lines if x.startswith("meshnet_time_to_first_token_seconds_sum")).split()[1])
    assert observed == pytest.approx(ttft, abs=1e-4)


# ---- receipts and transcripts (ADR-0067) ------------------------------------------------


async def test_a_hop_call_answers_with_the_nodes_signed_receipt_of_it(asgi_client, tail_runtime):
    from meshnet.dataplane.frames import FLAG_LAST_ONLY
    from meshnet.dataplane.receipts import Receipt, verify_step
    from meshnet.protocol.signing import unb64url
    from tests.payloads import node_key

    app = build_app(TAIL_SETTINGS, runtime=tail_runtime)
    client = await asgi_client(app, "http://node-tail")
    body = wire.encode(hidden_states(4, seed=5), dtype="float32")
    resp = await post_forward(client, body, fwd_headers(new_session()))
    assert resp.status_code == 200 and "X-Meshnet-Receipt" not in resp.headers  # no identity yet: nothing to sign with
    app.state.node.step_key = node_key("node-tail")  # as the tracker agent sets it when it starts
    session = uuid.uuid4().hex
    resp = await post_forward(client, body, fwd_headers(session, **{"X-Meshnet-Last-Only": "1"}))
    assert resp.status_code == 200, resp.text
    receipt = Receipt.from_bytes(unb64url(resp.headers["X-Meshnet-Receipt"]))
    public = node_key("node-tail").public_key()
    # no X-Meshnet-Model header: the model signed is "" (a mesh's entry always names it)
    assert verify_step(public, "", session, LayerRange(2, 4), 0, 4, FLAG_LAST_ONLY, body, resp.content, receipt) == ""
    assert verify_step(public, "", session, LayerRange(2, 4), 0, 4, 0, body, resp.content,
                       receipt) != ""  # the flags are signed too
    assert verify_step(public, "", session, LayerRange(2, 3), 0, 4, FLAG_LAST_ONLY, body, resp.content,
                       receipt) != ""  # and the layers
    assert verify_step(public, "tiny-llama", session, LayerRange(2, 4), 0, 4, FLAG_LAST_ONLY, body, resp.content,
                       receipt) != ""  # and the model


async def test_a_transcript_is_given_only_to_a_holder_of_its_chain_key(asgi_client, tail_runtime):
    from meshnet.dataplane.receipts import TranscriptStep
    from meshnet.protocol.signing import b64url

    app = build_app(TAIL_SETTINGS, runtime=tail_runtime)
    client = await asgi_client(app, "http://node-tail")
    chain, key = uuid.uuid4().hex, "ab" * 8
    app.state.node.transcripts.record(chain, key, TranscriptStep(0, 1, 0, b"in", b"out"))
    resp = await client.get(f"/v1/transcripts/{chain}", headers={"X-Meshnet-Chain-Key": key})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"chain_id": chain, "node_id": "node-tail", "steps": [
        {"position": 0, "tokens": 1, "flags": 0, "input": b64url(b"in"), "output": b64url(b"out")}]}
    for headers in ({"X-Meshnet-Chain-Key": "cd" * 8}, {}):
        assert_envelope(await client.get(f"/v1/transcripts/{chain}", headers=headers), 404, "no_transcript")
    assert_envelope(await client.get(f"/v1/transcripts/{uuid.uuid4().hex}", headers={"X-Meshnet-Chain-Key": key}),
                    404, "no_transcript")
