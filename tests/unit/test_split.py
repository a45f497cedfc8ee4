"""Even layer splits for `meshnet serve --nodes N` (meshnet.cli.serve.split_layers)."""

from __future__ import annotations

import pytest

from meshnet.cli.serve import memory_per_node_mb, split_layers


@pytest.mark.parametrize("num_layers, parts, expected", [
    (30, 3, ["0-9", "10-19", "20-29"]),
    (30, 1, ["0-29"]),
    (30, 4, ["0-7", "8-15", "16-22", "23-29"]),
    (10, 3, ["0-3", "4-6", "7-9"]),
    (4, 4, ["0-0", "1-1", "2-2", "3-3"]),
    (4, 2, ["0-1", "2-3"]),
    (1, 1, ["0-0"]),
])
def test_split_layers(num_layers, parts, expected):
    ranges = split_layers(num_layers, parts)
    assert [str(r) for r in ranges] == expected
    assert ranges[0].start == 0 and ranges[-1].end == num_layers
    assert all(a.end == b.start for a, b in zip(ranges, ranges[1:]))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("num_layers, parts", [(30, 0), (30, -1), (4, 5), (0, 1)])
def test_split_layers_rejects_impossible_splits(num_layers, parts):
    with pytest.raises(ValueError, match=f"cannot split {num_layers} layers into {parts} shards"):
        split_layers(num_layers, parts)


@pytest.mark.parametrize("nodes, total_gib, expected_mb", [(3, 24, 8192), (1, 24, 24576), (4, 2, 512)])
def test_local_nodes_split_the_machines_memory(nodes, total_gib, expected_mb):
    assert memory_per_node_mb(nodes, total_gib * 1024**3) == expected_mb
