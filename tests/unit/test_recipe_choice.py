"""``--quantization auto`` (ADR-0065, meshnet.node.recipe_choice): the decision over measured
samples, the kept samples, and the flags it refuses."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from meshnet.cli.main import app
from meshnet.node.recipe_choice import RecipeSample, choose, samples_of

TOLERANCE = {"int8": 0.15, "int4": 0.15}


def samples(**rates) -> list[RecipeSample]:
    """``recipe=(tokens/s alone, tokens/s of 8, distance)`` -> samples."""
    return [s for recipe, (one, eight, distance) in rates.items()
            for s in (RecipeSample(recipe, 1, one, distance), RecipeSample(recipe, 8, eight, distance))]


def test_the_fastest_recipe_within_the_tolerance_is_chosen_and_says_why():
    # this host's figures (2 threads, SmolLM2's sample layers): int4 is fastest alone and batched
    choice = choose(samples(float32=(140, 792, 0), bfloat16=(178, 981, 0.019), int8=(267, 1034, 0.036),
                            int4=(315, 1108, 0.042)), TOLERANCE)
    assert (choice.quantization, choice.compute_dtype) == ("int4", "bfloat16")
    assert choice.reason.startswith("int4: decode tokens/s at 1 / 8 session(s): float32 140 / 792; ")
    assert "worst slowdown 1.00x, distance to float32 0.042" in choice.reason


def test_a_recipe_beyond_the_doctors_tolerance_is_never_chosen():
    choice = choose(samples(bfloat16=(178, 981, 0.019), int4=(315, 1108, 0.4)), TOLERANCE)
    assert choice.quantization == "bfloat16" and "beyond the doctor's tolerance: int4" in choice.reason


def test_a_less_exact_recipe_needs_a_clear_gain_at_every_session_count():
    # int8 5 % faster alone: within the margin, bfloat16 stays
    assert choose(samples(bfloat16=(100, 500, 0.02), int8=(105, 520, 0.04)), TOLERANCE).quantization == "bfloat16"
    # int8 20 % faster alone but 30 % slower in a batch of 8: its worst slowdown (1.30x) loses to 1.20x
    assert choose(samples(bfloat16=(100, 500, 0.02), int8=(120, 385, 0.04)), TOLERANCE).quantization == "bfloat16"
    # twice as fast alone and 23 % slower batched: bfloat16's worst slowdown (2.0x) loses
    assert choose(samples(bfloat16=(100, 500, 0.02), int8=(200, 405, 0.04)), TOLERANCE).quantization == "int8"
    # float32 is exact: bfloat16 must beat it by the margin too
    assert choose(samples(float32=(100, 500, 0), bfloat16=(108, 540, 0.02)), TOLERANCE).quantization == "float32"
    assert choose(samples(float32=(100, 500, 0), bfloat16=(150, 700, 0.02)), TOLERANCE).compute_dtype == "bfloat16"


def test_nothing_within_the_tolerance_is_an_error():
    with pytest.raises(ValueError, match="no recipe was measured within the doctor's tolerance"):
        choose(samples(int4=(315, 1108, 0.9)), TOLERANCE)


def test_kept_samples_come_back_and_damaged_ones_are_measured_again():
    kept = [{"recipe": "int4", "sessions": 1, "tokens_per_s": 315.0, "distance": 0.04}]
    assert samples_of(kept) == [RecipeSample("int4", 1, 315.0, 0.04)]
    assert samples_of([{"recipe": "int4"}]) is None and samples_of("int4") is None and samples_of([]) is None


def test_auto_refuses_a_dtype_and_needs_a_model():
    runner = CliRunner()
    result = runner.invoke(app, ["node", "start", "--quantization", "auto", "--dtype", "float32",
                                 "--shard-start", "0", "--shard-end", "1", "--model", "tiny-llama"])
    assert result.exit_code == 1
    assert "--quantization auto chooses the compute dtype too" in result.output
