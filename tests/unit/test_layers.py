"""LayerRange (meshnet.layers): half-open inside, inclusive at the HTTP edge (ADR-0002)."""

from __future__ import annotations

import pytest

from meshnet.layers import LayerRange


def test_half_open_basics():
    layers = LayerRange(2, 5)
    assert len(layers) == 3
    assert [i for i in range(7) if i in layers] == [2, 3, 4]
    assert "3" not in layers and 3.0 not in layers
    assert str(layers) == "2-4"


@pytest.mark.parametrize("start, end", [(-1, 3), (3, 3), (4, 2)])
def test_invalid_ranges_raise(start, end):
    with pytest.raises(ValueError, match=rf"invalid layer range \[{start}, {end}\)"):
        LayerRange(start, end)


@pytest.mark.parametrize("shard_start, shard_end, half_open", [(0, 29, (0, 30)), (10, 19, (10, 20)), (3, 3, (3, 4))])
def test_inclusive_conversion_round_trips(shard_start, shard_end, half_open):
    layers = LayerRange.from_inclusive(shard_start, shard_end)
    assert (layers.start, layers.end) == half_open
    assert layers.to_inclusive() == (shard_start, shard_end)


def test_contains_range_and_overlaps():
    outer = LayerRange(0, 10)
    assert outer.contains_range(LayerRange(0, 10)) and outer.contains_range(LayerRange(3, 5))
    assert not outer.contains_range(LayerRange(5, 11))
    assert LayerRange(0, 5).overlaps(LayerRange(4, 8))
    assert not LayerRange(0, 5).overlaps(LayerRange(5, 8))  # half-open: they only touch


def test_ordering_and_hashing():
    assert sorted([LayerRange(5, 6), LayerRange(0, 9), LayerRange(0, 3)]) == [
        LayerRange(0, 3), LayerRange(0, 9), LayerRange(5, 6)]
    assert len({LayerRange(0, 3), LayerRange(0, 3)}) == 1


@pytest.mark.parametrize("text, expected", [("0-9", LayerRange(0, 10)), ("29-29", LayerRange(29, 30))])
def test_parse_inclusive_operator_form(text, expected):
    assert LayerRange.parse(text) == expected


@pytest.mark.parametrize("text", ["", "5", "a-b", "-1-4"])
def test_parse_rejects_malformed_text(text):
    with pytest.raises(ValueError, match="layer range must look like 'START-END'"):
        LayerRange.parse(text)


def test_parse_rejects_a_reversed_range_saying_so():
    with pytest.raises(ValueError, match="layer range '9-3': END must be >= START"):
        LayerRange.parse("9-3")
