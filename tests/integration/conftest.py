"""Fixtures for real-process tests. They use the real SmolLM2 weights from the default cache
(``make test`` pulls them first); without them these tests skip with that reason."""

from __future__ import annotations

import pytest

from meshnet.models.sources import is_ready, model_dir

REAL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real_model_path():
    path = model_dir(REAL)
    if not is_ready(path):
        pytest.skip(f"real model not cached at {path}: run `meshnet models pull` (make test does)")
    return path
