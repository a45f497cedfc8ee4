"""Non-Llama families across real processes: a tracker and three node processes serving a tiny
seeded Gemma 3 (sliding and global layers, soft-capped logits), Qwen3-MoE (experts), Qwen3.5
(linear-attention layers with recurrent state beside full attention) or gpt-oss (attention sinks,
experts), float32 on the wire; the greedy tokens equal transformers' ``generate`` on the whole model."""

from __future__ import annotations

import pytest
import torch

from meshnet.models.sources import resolve
from meshnet.node.entry import chat_token_ids
from tests.integration.mesh import Mesh

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse in a storm."}]


@pytest.mark.parametrize("model", ["tiny-gemma3", "tiny-qwen3-moe", "tiny-qwen3-5", "tiny-gpt-oss"])
def test_three_processes_of_a_family_give_generates_tokens(model, tmp_path):
    from transformers import AutoTokenizer

    from meshnet.models.checkpoints import whole_model

    mesh = Mesh(tmp_path / "logs")
    try:
        mesh.start_tracker(model)
        for name, (a, b) in {"a": (0, 1), "b": (2, 2), "c": (3, 3)}.items():
            mesh.start_node(name, "--model", model, "--shard-start", str(a), "--shard-end", str(b),
                            "--dtype", "float32", "--wire-dtype", "float32")
        mesh.wait_routable(model, 120)
        resp = mesh.chat(model, STORY, max_tokens=24)
        assert resp.status_code == 200, resp.text
        data = resp.json()
    finally:
        mesh.stop()
    assert [(h["node_id"], h["start_layer"], h["end_layer"]) for h in data["meshnet"]["route"]] == [
        ("a", 0, 1), ("b", 2, 2), ("c", 3, 3)]
    path = resolve(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    whole = whole_model(path)
    prompt = torch.tensor([chat_token_ids(tokenizer, STORY)])
    with torch.inference_mode():
        out = whole.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                             pad_token_id=0)[0, prompt.shape[1]:].tolist()
    expected = out[:out.index(2)] if 2 in out else out  # the mesh stops at the end token (id 2), unsent
    got = data["meshnet"]["completion_token_ids"]
    print(f"{model}: {len(got)} tokens through 3 processes: {got}")
    assert got == expected and len(got) > 0
