"""The torch-free evidence measure shared by admission and spot-checks (ADR-0042)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshnet.node import wire
from meshnet.errors import WireError
from meshnet.dataplane.evidence import audit_tolerance, challenge_frame, frame_distance, outvoted, tolerance
from meshnet.dataplane.frames import read_array as read_frame


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("compress", [False, True])
def test_read_frame_gives_the_values_wire_decode_gives(dtype, compress):
    tensor = torch.zeros(1, 64, 32) if compress else torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    body = wire.encode(tensor, dtype=dtype, compress=compress)
    expected = wire.decode(body).float().numpy()
    got = read_frame(body)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_the_challenge_frame_is_a_float32_frame_of_its_seed():
    body = challenge_frame(7, 16, 64)
    tensor = wire.decode(body)
    assert tensor.dtype == torch.float32 and tuple(tensor.shape) == (1, 16, 64)
    assert body == challenge_frame(7, 16, 64) and body != challenge_frame(8, 16, 64)


def test_distance_is_relative_l2_and_infinite_for_other_shapes():
    a = torch.ones(1, 2, 4)
    assert frame_distance(wire.encode(a, dtype="float32"), wire.encode(a, dtype="float32")) == 0.0
    b = a.clone()
    b[0, 0, 0] = 2.0  # ||a-b|| = 1, ||b|| = sqrt(7 + 4)
    assert frame_distance(wire.encode(a, dtype="float32"), wire.encode(b, dtype="float32")) == pytest.approx(
        1 / np.sqrt(11), rel=1e-6)
    assert frame_distance(wire.encode(a, dtype="float32"), wire.encode(torch.ones(1, 3, 4), dtype="float32")) == float(
        "inf")


@pytest.mark.parametrize("body", [b"", b"MSHN", b"XXXX\x01\x02\x01\x00\x01\x00\x00\x00" + b"\x00" * 4,
                                  b"MSHN\x01\x02\x01\x00\x02\x00\x00\x00" + b"\x00" * 4])
def test_a_body_that_is_not_a_frame_is_a_wire_error(body):
    with pytest.raises(WireError):
        read_frame(body)


@pytest.mark.parametrize("recipes, expected", [
    (("float32",), 1e-3), (("bfloat16", "float32"), 0.05), (("bfloat16", "int8"), 0.15), (("nf4", "bfloat16"), 0.3),
    (("something-new",), 0.3), ((), 0.05)])
def test_tolerance_is_the_loosest_of_the_recipes(recipes, expected):
    assert tolerance(*recipes) == expected


@pytest.mark.parametrize("recipes, expected", [
    (("bfloat16", "bfloat16"), 0.018), (("float32", "float32"), 1e-3), (("bfloat16", "float32"), 0.018),
    (("int8", "bfloat16"), 0.15), (("something-new",), 0.3), ((), 0.018)])
def test_the_audit_tolerance_is_tighter_where_measured_and_the_recipes_own_elsewhere(recipes, expected):
    assert audit_tolerance(*recipes) == expected


@pytest.mark.parametrize("distances, loser", [
    ({("x", "y"): 0.9, ("x", "z"): 0.8, ("y", "z"): 0.0}, "x"),     # y and z agree against x
    ({("x", "y"): 0.9, ("x", "z"): 0.0, ("y", "z"): 0.7}, "y"),     # the second holder lost
    ({("y", "x"): 0.0, ("z", "x"): 0.9, ("z", "y"): 0.9}, "z"),     # either key order
    ({("x", "y"): 0.9, ("x", "z"): 0.9, ("y", "z"): 0.9}, None),    # three different answers
    ({("x", "y"): 0.9, ("x", "z"): 0.04, ("y", "z"): 0.04}, None),  # z agrees with both: no majority against one
    ({("x", "y"): 0.9}, None),                                      # no third measurement
])
def test_outvoted_needs_two_holders_that_agree_against_the_third(distances, loser):
    assert outvoted("x", "y", "z", distances, 0.05) == loser
