"""US-014 end to end: `meshnet serve` starts a tracker that serves the first layers itself, and a
chat at the tracker is answered with the tracker as the route's first hop and the same greedy
tokens as transformers' own `generate` (float32 end to end); SIGTERM to such a tracker drains
its node and itself together. Real processes, real SmolLM2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh, free_port

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def wait_ready(proc: subprocess.Popen, timeout_s: float) -> list[str]:
    """Lines ``meshnet serve`` printed up to its ``READY`` line (bounded by ``timeout_s``)."""
    deadline, lines = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("READY"):
            return lines
    raise AssertionError("meshnet serve did not get ready:\n" + "".join(lines))


def test_serve_answers_through_the_tracker_as_first_hop(real_model_path):
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen([sys.executable, "-m", "meshnet.cli.main", "serve", "--port", str(port), "--nodes", "3",
                              "--dtype", "float32", "--wire-dtype", "float32", "--heartbeat-interval", "1",
                              "--drain-grace", "5"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    try:
        lines = wait_ready(serve, 300)
        assert any("a tracker serving layers 0-9 and 2 node(s)" in line for line in lines), lines
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=300,
                          json={"model": REAL, "messages": STORY, "max_tokens": 24, "temperature": 0})
        assert resp.status_code == 200, resp.text
        block = resp.json()["meshnet"]
        route = [(h["node_id"], h["endpoint"], h["start_layer"], h["end_layer"]) for h in block["route"]]
        assert route[0] == ("tracker", f"{url}/node", 0, 9)  # the first hop is the tracker's own node
        assert [(r[0], r[2], r[3]) for r in route[1:]] == [("node-1", 10, 19), ("node-2", 20, 29)]
        nodes = {n["node_id"]: n for n in httpx.get(f"{url}/v1/nodes", timeout=10).json()["nodes"]}
        assert sorted(nodes) == ["node-1", "node-2", "tracker"] and nodes["tracker"]["reachable"]
        health = httpx.get(f"{url}/node/v1/health", timeout=10).json()
        assert health["node_id"] == "tracker" and health["compute_dtype"] == "float32"
        got = block["completion_token_ids"]
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/v1/health", timeout=2)
    tok = AutoTokenizer.from_pretrained(real_model_path)
    model = whole_model(real_model_path)
    ids = tok.apply_chat_template(STORY, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    expected = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(got) == 24 and got == expected


def test_sigterm_to_a_tracker_serving_layers_finishes_the_stream_then_exits(real_model_path, tmp_path):
    """The tracker's process drains its node and itself together (ADR-0032, ADR-0044): a stream in
    flight ends with [DONE] and the undisturbed tokens, a new chat meanwhile is a 503 draining,
    and the process exits 0 within its grace."""
    float32 = ["--dtype", "float32", "--wire-dtype", "float32"]
    mesh = Mesh(tmp_path, heartbeat_s=1.0)
    try:
        mesh.start_tracker(REAL, node_timeout_s=25.0,
                           extra=["--serve-layers", "0-9", "--threads", "1", "--drain-grace", "30", *float32])
        for name, (a, b) in (("node-1", (10, 19)), ("node-2", (20, 29))):
            mesh.start_node(name, "--model", REAL, "--shard-start", str(a), "--shard-end", str(b), *float32)
        mesh.wait_routable(REAL, 300)
        # long enough that the stream is still in flight well after the signal: the entry's loop is
        # free (ADR-0049), so 12 tokens after the 4th would be over within the half second below
        expected, meta, _ = mesh.stream_chat(REAL, STORY, 64)
        assert meta["route"][0]["node_id"] == "tracker" and len(expected) == 64
        signalled: dict = {}

        def on_token(count: int) -> None:
            if count == 4 and not signalled:
                proc = mesh.take("tracker")  # waited for here; mesh.stop() still stops it by PID
                signalled.update(proc=proc, t=time.monotonic())
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)  # the signal handler starts the drain on the event loop
                signalled["meanwhile"] = mesh.chat(REAL, max_tokens=2)

        tokens, _, lines = mesh.stream_chat(REAL, STORY, 64, on_token)
        assert lines[-1] == "[DONE]" and tokens == expected
        refused = signalled["meanwhile"]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
        assert signalled["proc"].wait(timeout=45) == 0
        assert time.monotonic() - signalled["t"] < 30
    finally:
        mesh.stop()
