"""Strict structured outputs on the real model (ADR-0053): 50 different JSON schemas (nested
objects, enums, arrays with ``maxItems``, numbers and integers with bounds, bounded strings),
greedy and sampled, streamed and not, through a tracker and a node serving SmolLM2. Every
answer ends with ``stop`` (the grammar closed it, not ``max_tokens``) and validates."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

from tests.integration.conftest import REAL
from tests.integration.mesh import Mesh, serving

pytestmark = pytest.mark.slow

WORDS = ["red", "green", "blue", "north", "south", "small", "large", "cat", "dog", "tea", "coffee", "yes", "no"]
KEYS = ["name", "color", "size", "count", "score", "tags", "kind", "level", "owner", "place", "price", "ok"]


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["enum", "integer", "number", "string", "boolean"])
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "integer":
        low = rng.randint(-5, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 24])}
    return {"type": "boolean"}


def schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema: 1-4 required keys, each a leaf, an array of leaves with
    ``maxItems`` or (once, near the top) a nested object."""
    props = {}
    for key in rng.sample(KEYS, rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            props[key] = schema(rng, depth + 1)
        elif roll < 0.4:
            props[key] = {"type": "array", "items": leaf(rng), "maxItems": rng.randint(1, 3)}
        else:
            props[key] = leaf(rng)
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = [schema(random.Random(k)) for k in range(50)]


@pytest.fixture(scope="module")
def mesh(real_model_path, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("schemas"), REAL, [(0, 29)]) as m:
        yield m


def answer(mesh: Mesh, body: dict) -> tuple[str, str]:
    """(content, finish_reason) of one choice, streamed or not."""
    if not body["stream"]:
        resp = httpx.post(f"{mesh.url}/v1/chat/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, finish = "", None
    with httpx.stream("POST", f"{mesh.url}/v1/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    text += chunk["choices"][0]["delta"].get("content") or ""
                    finish = chunk["choices"][0]["finish_reason"] or finish
    return text, finish


def test_fifty_strict_schemas_greedy_and_sampled_streamed_and_not_all_stop_and_validate(mesh):
    failures = []
    for k, s in enumerate(SCHEMAS):
        body = {"model": REAL, "max_tokens": 256, "temperature": 0 if k % 2 == 0 else 0.8, "seed": k,
                "stream": k % 4 >= 2,
                "messages": [{"role": "user", "content": f"Describe something as JSON with the keys "
                                                         f"{', '.join(s['properties'])}."}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": f"thing{k}", "schema": s, "strict": True}}}
        text, finish = answer(mesh, body)
        try:
            jsonschema.validate(json.loads(text), s)
            assert finish == "stop"
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((k, finish, text[:200], str(exc)[:200]))
    for f in failures:
        print("FAIL", f)
    assert failures == []
