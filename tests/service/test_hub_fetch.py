"""A node fetches only its own layers from a hub (meshnet.models.sources).

A local HTTP server stands in for the hub (``HF_ENDPOINT``): it serves a tiny six-layer Llama
whose weights are split over three safetensors files, ``model.safetensors.index.json`` naming
which holds what, and records every file requested. Each node's layer range then fetches the
metadata and exactly the weight files holding its tensors, and the shard it loads gives the
same hidden states as the whole model's layers.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnet.errors import ModelSourceError
from meshnet.layers import LayerRange
from meshnet.models import sources

REPO = "meshnet-test/tiny-six"
SHA = "0123456789abcdef0123456789abcdef01234567"
#: which file holds what: embeddings and layers 0-1, layers 2-3, layers 4-5 and the final norm
FILES = {"model-00001-of-00003.safetensors": ("model.embed_tokens.", "model.layers.0.", "model.layers.1."),
         "model-00002-of-00003.safetensors": ("model.layers.2.", "model.layers.3."),
         "model-00003-of-00003.safetensors": ("model.layers.4.", "model.layers.5.", "model.norm.")}


def build_repo(root: Path) -> Path:
    """The repository's files: config, tokenizer, three weight files and their index."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                  max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    repo = root / "repo"
    config.save_pretrained(repo)
    sources.byte_tokenizer(config.vocab_size).save_pretrained(repo)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    weight_map = {}
    for name, prefixes in FILES.items():
        part = {k: v for k, v in state.items() if k.startswith(prefixes)}
        save_file(part, repo / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    assert set(weight_map) == set(state)
    (repo / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return repo


class FakeHub:
    """The hub calls the client makes: a repository's revision and file tree, and a file by name."""

    def __init__(self, repo: Path) -> None:
        self.repo, self.fetched = repo, []

    def app(self) -> Starlette:
        async def info(request: Request) -> JSONResponse:
            files = sorted(p.name for p in self.repo.iterdir())
            return JSONResponse({"id": REPO, "modelId": REPO, "sha": SHA, "siblings": [{"rfilename": f} for f in files]})

        async def tree(request: Request) -> JSONResponse:
            return JSONResponse([{"type": "file", "path": p.name, "size": p.stat().st_size,
                                  "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                                 for p in sorted(self.repo.iterdir())])

        async def resolve(request: Request) -> Response:
            path = self.repo / request.path_params["file"]
            if not path.is_file():
                return JSONResponse({"error": "Entry not found"}, status_code=404,
                                    headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": SHA})
            body = path.read_bytes()
            headers = {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                       "Content-Length": str(len(body))}
            if request.method == "HEAD":
                return Response(b"", headers=headers)
            self.fetched.append(path.name)
            return Response(body, headers=headers, media_type="application/octet-stream")

        org, name = REPO.split("/")
        return Starlette(routes=[
            Route(f"/api/models/{org}/{name}/revision/{{rev}}", info),
            Route(f"/api/models/{org}/{name}/tree/{{rev}}", tree),
            Route(f"/{org}/{name}/resolve/{{rev}}/{{file:path}}", resolve, methods=["GET", "HEAD"]),
        ])


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    fake = FakeHub(build_repo(tmp_path_factory.mktemp("hub")))
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "the fake hub did not start"
        time.sleep(0.02)
    fake.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        yield fake
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def cache(tmp_path, monkeypatch, hub):
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    hub.fetched.clear()
    return tmp_path


def weights_fetched(hub: FakeHub) -> list[str]:
    return sorted(f for f in hub.fetched if f.endswith(".safetensors"))


@pytest.mark.parametrize("layers, entry, files", [
    (LayerRange(2, 4), False, ["model-00002-of-00003.safetensors"]),
    (LayerRange(3, 6), False, ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]),
    (LayerRange(0, 2), True, ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]),
])
def test_a_node_fetches_only_the_files_of_its_layers(cache, hub, layers, entry, files):
    path = sources.resolve(REPO, layers=layers, entry=entry)
    assert weights_fetched(hub) == files  # the entry also needs the final norm, in the last file
    assert "config.json" in hub.fetched and "model.safetensors.index.json" in hub.fetched
    assert sorted(p.name for p in path.glob("*.safetensors")) == files
    print(f"layers {layers}{' (entry)' if entry else ''}: fetched {', '.join(weights_fetched(hub))}")


def test_a_second_range_fetches_only_what_is_missing_and_the_split_computes_the_whole_model(cache, hub):
    from transformers import AutoModelForCausalLM

    from meshnet.models.caches import KVCache
    from meshnet.models.shard import ShardModel

    sources.resolve(REPO, layers=LayerRange(2, 4))
    hub.fetched.clear()
    path = sources.resolve(REPO, layers=LayerRange(2, 6))
    assert weights_fetched(hub) == ["model-00003-of-00003.safetensors"]
    sources.resolve(REPO, layers=LayerRange(0, 2))
    assert weights_fetched(hub) == ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    entry, rest = ShardModel(path, LayerRange(0, 2)), ShardModel(path, LayerRange(2, 6))
    whole = AutoModelForCausalLM.from_pretrained(hub.repo, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 300, 42, 7]])
    with torch.inference_mode():
        expected = whole(ids).logits.float()
    hidden = entry.forward(entry.embed_tokens(ids, 0), KVCache(), 0)
    torch.testing.assert_close(entry.logits(rest.forward(hidden, KVCache(), 0)), expected, atol=1e-4, rtol=0)


def test_a_hub_that_lacks_the_repository_is_one_clear_error(cache, hub):
    with pytest.raises(ModelSourceError, match="cannot fetch 'meshnet-test/nothing-here' from the hub"):
        sources.resolve("meshnet-test/nothing-here", layers=LayerRange(0, 2))


def test_models_add_reads_only_the_config_and_the_added_preset_fetches_only_its_layers(cache, hub, monkeypatch):
    from meshnet.models.catalog import add_preset, preset_for
    from meshnet.presets import get_preset

    monkeypatch.setenv("MESHNET_USER_PRESETS", str(cache / "added.toml"))
    preset = preset_for(REPO)
    assert weights_fetched(hub) == [] and "config.json" in hub.fetched
    add_preset(preset)
    added = get_preset("tiny-six")
    assert (added.hf_repo, added.family, added.num_layers, added.source) == (REPO, "llama", 6, {"kind": "hub"})
    assert added.bytes_per_layer == {"bfloat16": 73_984, "int8": 37_376, "int4": 23_552, "nf4": 19_520}
    hub.fetched.clear()
    sources.resolve("tiny-six", layers=LayerRange(2, 4))
    assert weights_fetched(hub) == ["model-00002-of-00003.safetensors"]
