"""Fixtures for real-process tests. They use the real SmolLM2 weights from the default cache
(``make test`` pulls them first); without them these tests skip with that reason. What their
processes write in a cache (node keys, tracker databases, operator tokens, the calibration)
goes to a cache of the test session, which links the default cache's converted models."""

from __future__ import annotations

import pytest

from meshnet.models.sources import cache_dir, is_ready, model_dir

REAL = "smollm2-135m-instruct"


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """``MESHNET_CACHE`` for the session: a fresh directory whose ``models`` is the default
    cache's (a symbolic link), so the real weights are found and nothing else is left behind."""
    shared = cache_dir() / "models"
    private = tmp_path_factory.mktemp("meshnet-cache")
    if shared.is_dir():
        (private / "models").symlink_to(shared.resolve(), target_is_directory=True)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MESHNET_CACHE", str(private))
        yield private


@pytest.fixture(scope="session")
def real_model_path():
    path = model_dir(REAL)
    if not is_ready(path):
        pytest.skip(f"real model not cached at {path}: run `meshnet models pull` (make test does)")
    return path
