"""Batched decode across real processes (ADR-0041, ADR-0064): eight concurrent greedy chats with
different prompt lengths through a three-node mesh, each equal to its solo run token for token, while
the nodes' metrics show forwards of more than one session. Three meshes, all at the default
``MESHNET_BATCH_INVARIANT=auto``:

- the default recipe (bfloat16, its wire and speculation as a user gets them);
- the default recipe on a CPU without native bfloat16, emulated: oneDNN held to AVX-512 without its
  bfloat16 instructions (``ONEDNN_MAX_CPU_ISA=AVX512_CORE``) and products from 4 rows on in float32,
  as such a host's timing chose in a clean-clone CI run (``MESHNET_UPCAST_MIN_ROWS=4``, ADR-0047). The
  float32 path's sums depend on the row count: before several sessions' rows were kept off it
  (``kernels.apart_product``, ADR-0064 amended 2026-12-08) this case differed under ``auto``, and the
  default case had to run at ``on`` to pass on such a host;
- int4 computing in float32 (what a host whose calibration picks float32 runs): its weight kernels
  compute each row alone and ``auto`` covers the rest (the attention of speculative spans). Before
  ``auto`` covered int4 in float32, one of the eight chats differed (with the host's kernels measured
  afresh, ``MESHNET_HOST_TIMINGS=off``; with ``off`` it still does).
"""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
TOPICS = ["the sea", "a robot who learns to paint", "why the sky is blue, in detail for a child of seven",
          "bread", "the history of the bicycle and how it changed the lives of people in cities",
          "cats", "a mountain village in winter at night", "rain"]
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["default", "no-native-bfloat16", "int4"])
def mesh(request, real_model_path, tmp_path_factory):
    """The mesh at the default recipe, at the default recipe on an emulated CPU without native
    bfloat16, and at int4 in float32, all at the default invariance (see the module doc)."""
    tmp = tmp_path_factory.mktemp("batching")
    recipe, env = [], {"MESHNET_BATCH_INVARIANT": "auto"}
    if request.param == "no-native-bfloat16":  # its own timings file: the emulated kernels' layouts stay its own
        recipe = ["--dtype", "bfloat16"]  # as that host's calibration chose (here, emulated, it picks float32)
        env |= {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MESHNET_UPCAST_MIN_ROWS": "4",
                "MESHNET_HOST_TIMINGS": str(tmp / "host-timings.json")}
    elif request.param == "int4":
        recipe = ["--quantization", request.param, "--dtype", "float32"]
    m = Mesh(tmp)
    try:
        m.start_tracker(REAL)
        for i, (a, b) in enumerate([(0, 9), (10, 19), (20, 29)]):
            m.start_node(f"node-{i}", "--model", REAL, "--shard-start", str(a), "--shard-end", str(b),
                         "--batch-window-ms", "20", *recipe, env=env)
        m.wait_routable(REAL, 240)
        yield m
    finally:
        m.stop()


def greedy(mesh: Mesh, topic: str) -> dict:
    resp = httpx.post(f"{mesh.url}/v1/chat/completions", timeout=300, json={
        "model": REAL, "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def batch_histogram(endpoint: str) -> tuple[float, float]:
    """(forward runs, steps run) from a node's ``meshnet_node_batch_size`` histogram."""
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in httpx.get(f"{endpoint}/metrics", timeout=10).text.splitlines()
               if line.startswith("meshnet_node_batch_size_")}
    return samples["meshnet_node_batch_size_count"], samples["meshnet_node_batch_size_sum"]


def test_eight_concurrent_greedy_sessions_each_equal_their_solo_run(mesh):
    solo = {topic: greedy(mesh, topic) for topic in TOPICS}
    prompt_lengths = {r["usage"]["prompt_tokens"] for r in solo.values()}
    assert len(prompt_lengths) >= 6  # ragged: the sessions sit at different positions
    endpoints = [n["endpoint"] for n in mesh.get("/v1/nodes")["nodes"]]
    before = {e: batch_histogram(e) for e in endpoints}
    with cf.ThreadPoolExecutor(len(TOPICS)) as pool:
        together = dict(zip(TOPICS, pool.map(lambda t: greedy(mesh, t), TOPICS, timeout=600)))
    for topic in TOPICS:
        want, got = solo[topic]["meshnet"], together[topic]["meshnet"]
        assert got["completion_token_ids"] == want["completion_token_ids"], topic
        # each token's log-probability too, to the last bit: rows that took another kernel in a batch
        # differ there long before a greedy choice changes
        assert together[topic]["choices"][0]["logprobs"] == solo[topic]["choices"][0]["logprobs"], topic
        assert len(got["completion_token_ids"]) == solo[topic]["usage"]["completion_tokens"] > 0
    for endpoint in endpoints:
        runs, steps = (a - b for a, b in zip(batch_histogram(endpoint), before[endpoint]))
        assert steps > runs > 0, f"{endpoint} ran {steps:.0f} steps in {runs:.0f} forwards: no batching"
