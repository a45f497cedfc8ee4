"""Batched decode through the node app (meshnet.node.app): concurrent hop calls of different
sessions run as one forward, answer each caller its own rows, and show in ``/metrics`` as
``meshnet_node_batch_size`` (tiny-llama layers [2,4), float32, in-process ASGI)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.testing import assert_close

from meshnet.node import wire
from meshnet.layers import LayerRange
from meshnet.models.caches import KVCache
from meshnet.node.app import build_app
from meshnet.node.runtime import NodeRuntime
from meshnet.node.settings import NodeSettings

MODEL = "tiny-llama"
LENGTHS = (2, 7, 4, 11, 5, 3, 9, 1)  # eight sessions at eight different positions


@pytest.fixture
def runtime(tiny_model_path) -> NodeRuntime:
    rt = NodeRuntime(compute_dtype="float32")
    rt.load(MODEL, tiny_model_path(MODEL), LayerRange(2, 4))
    return rt


def frame(seq: int, seed: int) -> torch.Tensor:
    return torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(seed))


def headers(session: str, position: int) -> dict:
    return {"X-Meshnet-Session": session, "X-Meshnet-Start-Layer": "2", "X-Meshnet-End-Layer": "3",
            "X-Meshnet-Position": str(position)}


async def post(client, session: str, hidden: torch.Tensor, position: int) -> torch.Tensor:
    resp = await client.post("/v1/forward", content=wire.encode(hidden, dtype="float32"),
                             headers=headers(session, position))
    assert resp.status_code == 200, resp.text
    return wire.decode(resp.content)


def batch_size_samples(text: str) -> dict[str, float]:
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("meshnet_node_batch_size_")}


async def test_concurrent_hop_calls_batch_and_each_equals_its_solo_run(asgi_client, runtime):
    client = await asgi_client(build_app(NodeSettings(node_id="node-b", port=8890), runtime=runtime), "http://node-b")
    shard = runtime.find_slot(MODEL, LayerRange(2, 4)).shard
    sessions = [f"s{i}" for i in range(len(LENGTHS))]
    solo = {}
    for i, (sid, n) in enumerate(zip(sessions, LENGTHS)):
        await post(client, sid, frame(n, i), 0)
        solo[sid] = KVCache()
        shard.forward(frame(n, i), solo[sid], 0)
    runtime.batcher.window_s = 30.0  # a leader now waits until all eight sessions are in (bounded below)
    runtime.batcher.active_s = 30  # a loaded host may take over 1 s between steps
    for step in range(2):
        steps = {sid: frame(1, 100 + 10 * step + i) for i, sid in enumerate(sessions)}
        outs = await asyncio.wait_for(asyncio.gather(*(
            post(client, sid, steps[sid], n + step) for sid, n in zip(sessions, LENGTHS))), timeout=60)
        for sid, n, out in zip(sessions, LENGTHS, outs):
            assert_close(out, shard.forward(steps[sid], solo[sid], n + step), rtol=1e-5, atol=1e-5)
    assert [size for _, size in runtime.batch_sizes][-2:] == [8, 8]
    samples = batch_size_samples((await client.get("/metrics")).text)
    assert samples["meshnet_node_batch_size_count"] == len(LENGTHS) + 2  # eight prefills alone, two batches
    assert samples["meshnet_node_batch_size_sum"] == len(LENGTHS) + 16
    assert samples['meshnet_node_batch_size_bucket{le="4.0"}'] == len(LENGTHS)
    assert samples['meshnet_node_batch_size_bucket{le="8.0"}'] == len(LENGTHS) + 2


async def test_the_node_has_worker_threads_for_a_full_batch(asgi_client, runtime):
    settings = NodeSettings(node_id="node-c", port=8891, max_batch_size=20)
    await asgi_client(build_app(settings, runtime=runtime), "http://node-c")
    executor = asyncio.get_running_loop()._default_executor
    assert executor is not None and executor._max_workers == settings.worker_threads == 80
