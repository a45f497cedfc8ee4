"""Quantized recipes (bitsandbytes on the CPU) serve SmolLM2 through a split."""

from __future__ import annotations

import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("recipe", ["int8", "nf4"])
def test_quantized_split_answers_the_france_question(recipe, real_model_path, tmp_path):
    mesh = Mesh(tmp_path)
    try:
        mesh.start_tracker(REAL)
        for name, (a, b) in {"head": (0, 14), "tail": (15, 29)}.items():
            mesh.start_node(name, "--model", REAL, "--shard-start", str(a), "--shard-end", str(b),
                            "--quantization", recipe)
        mesh.wait_routable(REAL, 180)
        nodes = mesh.get("/v1/nodes")["nodes"]
        for n in nodes:
            assert n["quantization"] == recipe
            shard = n["shards"][0]
            assert shard["quantization"] == recipe and shard["capability"]["passed"]
        reply = mesh.chat(REAL, max_tokens=12).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
        assert [(h["start_layer"], h["end_layer"]) for h in reply["meshnet"]["route"]] == [(0, 14), (15, 29)]
    finally:
        mesh.stop()
