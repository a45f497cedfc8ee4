"""The main job end to end: SmolLM2 split across three real node processes and a tracker."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import httpx
import pytest
import torch

from meshnet.models.sources import cache_dir
from tests.integration.conftest import REAL
from tests.integration.mesh import free_port, three_hops

pytestmark = pytest.mark.slow
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def mesh(real_model_path, tmp_path_factory):
    with three_hops(tmp_path_factory.mktemp("mesh"), REAL) as m:
        yield m


def chat(mesh, messages, **kw):
    body = {"model": REAL, "messages": messages, "temperature": 0, **kw}
    resp = httpx.post(f"{mesh.url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_france_answer_through_three_hops(mesh):
    data = chat(mesh, FRANCE, max_tokens=32)
    assert "Paris" in data["choices"][0]["message"]["content"]
    route = data["meshnet"]["route"]
    assert [(h["node_id"], h["start_layer"], h["end_layer"]) for h in route] == [
        ("node-0", 0, 9), ("node-1", 10, 19), ("node-2", 20, 29)]
    assert data["meshnet"]["decode_tokens_per_s"] > 0
    assert data["usage"]["completion_tokens"] == len(data["meshnet"]["completion_token_ids"])


def test_openai_client_streaming_and_not(mesh):
    from openai import OpenAI

    client = OpenAI(base_url=f"{mesh.url}/v1", api_key="unused")
    full = client.chat.completions.create(model=REAL, messages=FRANCE, temperature=0, max_tokens=32)
    text = full.choices[0].message.content
    assert "Paris" in text
    pieces = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(model=REAL, messages=FRANCE, temperature=0, max_tokens=32, stream=True)
              if c.choices]
    assert "".join(pieces) == text
    assert [m.id for m in client.models.list().data] == [REAL]


def test_float32_wire_greedy_equals_transformers_generate(mesh, real_model_path):
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    data = chat(mesh, STORY, max_tokens=32)
    got = data["meshnet"]["completion_token_ids"]
    tok = AutoTokenizer.from_pretrained(real_model_path)
    model = whole_model(real_model_path)
    ids = tok.apply_chat_template(STORY, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    expected = [t for t in out if t != tok.eos_token_id][:len(out)]
    assert len(got) == 32
    assert got == expected


def test_echoed_prompt_logprobs_across_three_hops_equal_transformers_log_softmax(mesh, real_model_path):
    """What an evaluation harness asks (``echo``, ``logprobs``, ``max_tokens: 0``): one logprob per
    prompt token, the first null, each within 1e-4 of transformers' float32 log-softmax over the
    unsplit model; the prompt is longer than one prefill chunk, so chunks are scored in turn."""
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    text = "The quick brown fox jumps over the lazy dog. " * 24  # about 240 tokens: two 128-token chunks
    resp = httpx.post(f"{mesh.url}/v1/completions", timeout=120, json={
        "model": REAL, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    lp = choice["logprobs"]
    tok = AutoTokenizer.from_pretrained(real_model_path)
    ids = tok(text)["input_ids"]
    assert len(ids) > 128 and len(lp["token_logprobs"]) == len(ids) and choice["text"] == text
    assert lp["token_logprobs"][0] is None and lp["tokens"] == [tok.decode([i]) for i in ids]
    model = whole_model(real_model_path)
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    want = [float(logp[i, t]) for i, t in enumerate(ids[1:])]
    worst = max(abs(got - w) for got, w in zip(lp["token_logprobs"][1:], want))
    print(f"echoed prompt logprobs: {len(ids)} tokens, largest difference from transformers {worst:.2e}")
    assert worst < 1e-4


def test_bad_chat_body_is_a_clear_400(mesh):
    resp = httpx.post(f"{mesh.url}/v1/chat/completions", json={"model": REAL, "messages": []}, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages"
    assert chat(mesh, FRANCE, max_tokens=8)["choices"][0]["message"]["content"]


def test_openai_parameters_on_the_real_mesh(mesh):
    """Issue inputs: each accepted parameter works through three hops, each refused one is a
    400 naming it, an alias reaches the model, a huge prompt is refused at once."""
    url = f"{mesh.url}/v1/chat/completions"
    for fields, param in (({"stop": [""]}, "stop"), ({"seed": 2**64}, "seed"),
                          ({"audio": {"voice": "x"}}, "audio"), ({"seed": 2**64, "stream": True}, "seed")):
        resp = httpx.post(url, json={"model": REAL, "messages": FRANCE, **fields}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    data = chat(mesh, FRANCE, n=3, logprobs=True, top_logprobs=3, max_tokens=4)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    for c in data["choices"]:
        assert len(c["logprobs"]["content"]) == 4 and len(c["logprobs"]["content"][0]["top_logprobs"]) == 3
    plain = chat(mesh, STORY, max_tokens=24)["choices"][0]["message"]["content"]
    assert chat(mesh, STORY, max_tokens=24, frequency_penalty=2.0)["choices"][0]["message"]["content"] != plain
    alias = chat(mesh, FRANCE, max_tokens=4, model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert alias["model"] == REAL
    entry = data["meshnet"]["route"][0]["endpoint"]
    resp = httpx.post(url, json={"model": REAL, "messages": [{"role": "user", "content": "hello world, " * 200000}]},
                      timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in resp.json()["error"]["message"]  # refused by the length bound, before tokenizing 2.6 MB
    assert httpx.get(f"{entry}/v1/health", timeout=5).status_code == 200


def test_meshnet_serve_then_chat_cli(real_model_path, tmp_path):
    """The README's run command path: `meshnet serve` brings up the mesh; `meshnet chat` answers."""
    port = free_port()
    env = {**os.environ}
    serve = subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "serve", "--port", str(port), "--nodes", "3",
                              "--heartbeat-interval", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env, text=True)
    try:
        deadline = time.monotonic() + 240
        lines = []
        while time.monotonic() < deadline:
            line = serve.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("READY"):
                break
        assert lines and lines[-1].startswith("READY"), "".join(lines)
        url = f"http://127.0.0.1:{port}"
        out = subprocess.run([sys.executable, "-m", "meshnet.cli.main", "chat", "What is the capital of France?",
                              "--url", url, "--no-stream", "--json"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert "Paris" in data["choices"][0]["message"]["content"]
        route = data["meshnet"]["route"]
        assert len(route) == 3 and route[0]["start_layer"] == 0 and route[-1]["end_layer"] == 29
        assert route[0]["node_id"] == "tracker"  # the tracker serves the first layers (ADR-0044)
        nodes = httpx.get(f"{url}/v1/nodes", timeout=10).json()["nodes"]
        assert sorted(n["node_id"] for n in nodes) == ["node-1", "node-2", "tracker"]
        # serve made an operator token (ADR-0035): only its owner can read it, and it is required
        token_file = cache_dir() / f"serve-{port}.operator-token"
        assert str(token_file) in "".join(lines) and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        drain = {"node_id": "node-x"}
        assert httpx.post(f"{url}/v1/operator/drain", json=drain, timeout=10).status_code == 401
        resp = httpx.post(f"{url}/v1/operator/drain", json=drain, timeout=10,
                          headers={"Authorization": f"Bearer {token_file.read_text().strip()}"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_node"
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=30)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2)
