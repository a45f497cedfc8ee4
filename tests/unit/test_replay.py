"""Replay of a hop's history as prefill chunks (meshnet.dataplane.replay), with a list-based codec."""

from __future__ import annotations

import json
import math

import pytest

from meshnet.dataplane.replay import rechunk


class ListCodec:
    """Activations are lists of token values; a frame is their JSON (no torch needed)."""

    def __init__(self) -> None:
        self.decoded = 0

    async def encode(self, hidden):
        return json.dumps(hidden).encode()

    async def decode(self, frame):
        self.decoded += 1
        return json.loads(frame)

    def concat(self, parts):
        return [x for part in parts for x in part]

    def split(self, hidden, tokens):
        return [hidden[i:i + tokens] for i in range(0, len(hidden), tokens)]


def history(sizes: list[int]) -> list[tuple[int, bytes, int]]:
    """Frames of ``sizes`` tokens from position 0; token k's activation is the value k."""
    out, position = [], 0
    for n in sizes:
        out.append((position, json.dumps(list(range(position, position + n))).encode(), n))
        position += n
    return out


async def replay(sizes: list[int], chunk: int, codec: ListCodec | None = None) -> list[tuple[int, list, int]]:
    codec = codec or ListCodec()
    return [(p, json.loads(f), n) async for p, f, n in rechunk(history(sizes), codec, chunk)]


@pytest.mark.parametrize("sizes, chunk", [
    ([8, 8, 8, 8, 5] + [1] * 10, 8),     # prompt of 37 in chunks of 8, then ten decode steps
    ([128, 22] + [1] * 54, 128),         # the real shape: one 150-token prompt, 54 steps
    ([1] * 300, 128),
    ([5], 128),
    ([3, 1, 1], 4),
    ([4, 4, 1], 4),
])
async def test_a_history_of_t_tokens_is_replayed_in_ceil_t_over_chunk_calls(sizes, chunk):
    chunks = await replay(sizes, chunk)
    total = sum(sizes)
    assert len(chunks) == math.ceil(total / chunk)
    assert [n for _, _, n in chunks] == [min(chunk, total - i * chunk) for i in range(len(chunks))]
    assert [p for p, _, _ in chunks] == [i * chunk for i in range(len(chunks))]
    assert [x for _, values, _ in chunks for x in values] == list(range(total))  # same activations, in order
    assert all(len(values) == n for _, values, n in chunks)


async def test_a_whole_chunk_on_a_boundary_is_passed_on_without_decoding():
    codec = ListCodec()
    chunks = await replay([4, 4, 1, 1], 4, codec)
    assert [n for _, _, n in chunks] == [4, 4, 2] and codec.decoded == 2  # only the two decode frames


async def test_an_empty_history_replays_nothing():
    assert await replay([], 8) == []


async def test_a_history_with_a_gap_is_refused():
    broken = history([4, 4])
    broken[1] = (5, broken[1][1], 4)
    with pytest.raises(ValueError, match="not contiguous"):
        _ = [c async for c in rechunk(broken, ListCodec(), 4)]
