"""Host-measured compute defaults (meshnet.node.calibration): the choice as a pure function over
measured samples, the thread budget, and one real measurement of the tiny model (cached)."""

from __future__ import annotations

import json

import pytest
import torch

from meshnet.models import linears
from meshnet.node.calibration import (Sample, calibrate, choose, host_key, max_processes, thread_budget,
                                      thread_candidates)


def samples(table: dict[tuple[str, int], float]) -> list[Sample]:
    return [Sample(d, t, v) for (d, t), v in table.items()]


@pytest.mark.parametrize("table, expected", [
    # this machine's batch-1 decode (DESIGN): float32 24 tok/s, bfloat16 15 -> float32
    ({("float32", 1): 24.0, ("bfloat16", 1): 15.0}, ("float32", 1)),
    # bfloat16 clearly faster (ADR-0006's figures) -> bfloat16
    ({("float32", 2): 8.0, ("bfloat16", 2): 16.0}, ("bfloat16", 2)),
    # bfloat16 faster, but by less than 10 %: exact float32 wins the tie
    ({("float32", 1): 20.0, ("bfloat16", 1): 21.9}, ("float32", 1)),
    ({("float32", 1): 20.0, ("bfloat16", 1): 22.0}, ("bfloat16", 1)),
    # the fewest threads within 5 % of the fastest count
    ({("float32", 1): 10.0, ("float32", 2): 18.0, ("float32", 4): 18.5, ("bfloat16", 1): 5.0,
      ("bfloat16", 2): 9.0, ("bfloat16", 4): 9.5}, ("float32", 2)),
    # more threads slower (small layers, shared cores): one thread
    ({("float32", 1): 30.0, ("float32", 2): 26.0, ("bfloat16", 1): 12.0, ("bfloat16", 2): 11.0}, ("float32", 1)),
    # the best bfloat16 count decides, not the same count as float32's best
    ({("float32", 1): 10.0, ("float32", 4): 10.0, ("bfloat16", 1): 8.0, ("bfloat16", 4): 30.0}, ("bfloat16", 4)),
    # a failed (zero) measurement never wins
    ({("float32", 1): 0.0, ("bfloat16", 1): 3.0}, ("bfloat16", 1)),
])
def test_choose(table, expected):
    choice = choose(samples(table))
    assert (choice.compute_dtype, choice.threads) == expected
    assert choice.reason


def batched(table: dict[tuple[str, int, int], float]) -> list[Sample]:
    return [Sample(d, t, v, n) for (d, t, n), v in table.items()]


@pytest.mark.parametrize("table, expected", [
    # a 2-core AVX2 host (2026-12-01, SmolLM2, two middle layers): bfloat16 1.38x faster alone,
    # 1.4x slower in a batch of 8 (no native bfloat16): its worst slowdown is the larger -> float32
    ({("float32", 1, 1): 271.0, ("bfloat16", 1, 1): 374.0, ("float32", 1, 8): 1400.0, ("bfloat16", 1, 8): 1000.0},
     ("float32", 1)),
    # bfloat16 faster at both counts (AVX-512 with native bfloat16) -> bfloat16
    ({("float32", 1, 1): 200.0, ("bfloat16", 1, 1): 300.0, ("float32", 1, 8): 900.0, ("bfloat16", 1, 8): 1000.0},
     ("bfloat16", 1)),
    # bfloat16 2x faster alone and only 1.2x slower batched: float32's worst (2.0) beats 1.1 x 1.2
    ({("float32", 1, 1): 100.0, ("bfloat16", 1, 1): 200.0, ("float32", 1, 8): 600.0, ("bfloat16", 1, 8): 500.0},
     ("bfloat16", 1)),
    # the thread count must hold at every session count: 1 thread is enough alone, not batched
    ({("float32", 1, 1): 100.0, ("float32", 2, 1): 101.0, ("float32", 1, 8): 400.0, ("float32", 2, 8): 700.0,
      ("bfloat16", 1, 1): 50.0, ("bfloat16", 2, 1): 50.0, ("bfloat16", 1, 8): 200.0, ("bfloat16", 2, 8): 300.0},
     ("float32", 2)),
])
def test_choose_weighs_a_lone_session_and_a_batch(table, expected):
    choice = choose(batched(table))
    assert (choice.compute_dtype, choice.threads) == expected
    assert "tokens/s at 1 / 8 session(s)" in choice.reason


def test_a_noisy_host_where_no_count_holds_at_every_session_count_gets_the_one_losing_least():
    # a loaded CI host measured 1 thread fastest alone and 2 fastest batched, each more than 5 % ahead:
    # no count is within tolerance at both (the choice raised "min() arg is an empty sequence")
    choice = choose(batched({("float32", 1, 1): 100.0, ("float32", 2, 1): 80.0,
                             ("float32", 1, 8): 300.0, ("float32", 2, 8): 400.0}), dtype="float32")
    assert (choice.compute_dtype, choice.threads) == ("float32", 2)  # 2 threads lose 20 %, 1 thread 25 %
    assert "none within 95% of the fastest at every session count" in choice.reason


def test_the_reason_names_both_counts_and_the_worst_slowdown():
    reason = choose(batched({("float32", 1, 1): 271.0, ("bfloat16", 1, 1): 374.0, ("float32", 1, 8): 1400.0,
                             ("bfloat16", 1, 8): 1000.0})).reason
    assert reason.startswith("tokens/s at 1 / 8 session(s): bfloat16 374 / 1000, float32 271 / 1400; "
                             "bfloat16's worst slowdown 1.40x")


def test_explicit_flags_win_over_the_measurement():
    table = samples({("float32", 1): 30.0, ("float32", 2): 60.0, ("bfloat16", 1): 10.0, ("bfloat16", 2): 20.0})
    assert (choose(table, dtype="bfloat16").compute_dtype, choose(table, dtype="bfloat16").threads) == ("bfloat16", 2)
    assert (choose(table, threads=1).compute_dtype, choose(table, threads=1).threads) == ("float32", 1)
    both = choose(table, dtype="bfloat16", threads=1)
    assert (both.compute_dtype, both.threads) == ("bfloat16", 1) and "as given" in both.reason


def test_choose_without_a_matching_sample_says_so():
    with pytest.raises(ValueError, match="no decode measurement for dtype bfloat16"):
        choose(samples({("float32", 1): 3.0}), dtype="bfloat16")


@pytest.mark.parametrize("cores, processes, budget, fit", [  # the thread split of `meshnet serve`
    (2, 3, 1, 2),     # this machine: 3 shards wanted, 2 fit with one thread each
    (2, 2, 1, 2),
    (16, 3, 5, 3),    # 15 of 16 cores, never 16 x 3
    (8, 1, 8, 1),
    (4, 4, 1, 4),
    (1, 3, 1, 1),
])
def test_thread_budget_never_oversubscribes(cores, processes, budget, fit):
    assert thread_budget(cores, processes) == budget
    assert max_processes(cores, processes) == fit
    assert thread_budget(cores, fit) * fit <= cores


@pytest.mark.parametrize("budget, expected", [(1, [1]), (2, [1, 2]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8]),
                                              (0, [1])])
def test_thread_candidates(budget, expected):
    assert thread_candidates(budget) == expected


def test_calibrate_measures_the_host_once_then_reads_the_cache(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MESHNET_CACHE", str(tiny_model_path("tiny-llama").parent.parent))
    cache = tmp_path / "calibration.json"
    first = calibrate("tiny-llama", 1, cache_file=cache, now=1000.0)
    assert first.compute_dtype in ("float32", "bfloat16") and first.threads == 1
    assert "measured now" in first.reason
    stored = json.loads(cache.read_text())
    (key, entry), = stored.items()
    assert "tiny-llama" in key and entry["measured_at"] == 1000.0
    assert sorted((s["dtype"], s["threads"], s["sessions"]) for s in entry["value"]) == [
        ("bfloat16", 1, 1), ("bfloat16", 1, 8), ("float32", 1, 1), ("float32", 1, 8)]
    assert all(s["tokens_per_s"] > 0 for s in entry["value"])
    again = calibrate("tiny-llama", 1, cache_file=cache, now=2000.0)
    assert (again.compute_dtype, again.threads) == (first.compute_dtype, first.threads)
    assert "cached measurement" in again.reason


def test_a_measurement_made_without_a_weight_layout_is_not_reused_with_it(monkeypatch):
    with_packing = host_key("tiny-llama", ["float32", "bfloat16"], [1, 2])
    half = "row,transposed,packed" if linears.packing_available(torch.bfloat16) else "row,transposed"  # AVX2: no
    assert with_packing.endswith(f"|layouts float32:row,transposed,packed;bfloat16:{half}")  # the wheel has oneDNN
    monkeypatch.setattr(linears, "packing_available", lambda dtype: False)
    without = host_key("tiny-llama", ["float32", "bfloat16"], [1, 2])
    assert without.endswith("|layouts float32:row,transposed;bfloat16:row,transposed") and without != with_packing


def test_calibrate_with_both_flags_measures_nothing(tmp_path):
    choice = calibrate("no-such-model", 4, dtype="float32", threads=3, cache_file=tmp_path / "c.json")
    assert (choice.compute_dtype, choice.threads) == ("float32", 3) and not (tmp_path / "c.json").exists()


def test_calibrate_falls_back_to_the_documented_default_when_the_model_cannot_be_read(tmp_path):
    (tmp_path / "empty-model").mkdir()  # a local directory without config.json: no network asked
    choice = calibrate(str(tmp_path / "empty-model"), 2, cache_file=tmp_path / "c.json")
    assert (choice.compute_dtype, choice.threads) == ("bfloat16", 2)
    assert "not measured" in choice.reason and "has no config.json" in choice.reason


def test_the_timings_a_measurement_made_serve_a_node_at_the_same_thread_count_only(tiny_model_path, monkeypatch,
                                                                                   tmp_path):
    import torch

    from meshnet.layers import LayerRange
    from meshnet.models.shard import ShardModel
    from meshnet.node.calibration import measure

    monkeypatch.setattr(linears, "LAYOUT_MIN_ELEMENTS", 0)  # the tiny model's weights are timed too
    monkeypatch.setenv("MESHNET_HOST_TIMINGS", str(tmp_path / "host-timings.json"))  # nothing measured yet
    timed = []
    real = linears.measure_layout
    monkeypatch.setattr(linears, "measure_layout", lambda *args: timed.append(torch.get_num_threads()) or real(*args))
    linears.layout.cache_clear()
    previous = torch.get_num_threads()
    try:
        samples = measure(tiny_model_path("tiny-llama"), ["float32"], [1, 2], rounds=1, steps=2)
        assert sorted((s.threads, s.sessions) for s in samples) == [(1, 1), (1, 8), (2, 1), (2, 8)]
        shapes = len(timed)
        assert shapes > 0 and set(timed) == {1}  # the sample shards are built at the first candidate count
        torch.set_num_threads(1)
        ShardModel(tiny_model_path("tiny-llama"), LayerRange(1, 3), dtype="float32", load_head=False)
        assert len(timed) == shapes  # a node at that count measures nothing again
        torch.set_num_threads(2)
        ShardModel(tiny_model_path("tiny-llama"), LayerRange(1, 3), dtype="float32", load_head=False)
        assert timed == [1] * shapes + [2] * shapes  # at another count, every shape once more
    finally:
        torch.set_num_threads(previous)
        linears.layout.cache_clear()


@pytest.mark.parametrize("config, weights, layers", [
    # SmolLM2-135M: 9 heads of 64 over 3 key-value heads, a 1536-wide gated MLP, two norms; 6.75 MiB a
    # layer in bfloat16 (its preset's 3,540,096 parameters a layer)
    ({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
      "num_key_value_heads": 3}, 3_540_096, 10),
    # GPT-2 small, biases and layer norms included: 13.5 MiB a layer in bfloat16
    ({"model_type": "gpt2", "n_embd": 768, "n_inner": None, "n_head": 12}, 7_087_872, 5),
    # Qwen3-30B-A3B's shape: 128 experts a layer, 48 layers of them make its 30 B parameters
    ({"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32,
      "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
      "moe_intermediate_size": 768}, 623_120_640, 2),
    ({"model_type": "mystery"}, 0, 2),  # sizes it cannot read: the 2-layer floor
])
def test_the_sample_holds_enough_layers_to_be_read_from_memory(monkeypatch, config, weights, layers):
    from meshnet.node.calibration import layer_weights, sample_layer_count

    monkeypatch.setattr(linears, "stream_bytes", lambda: 64 << 20)  # twice a 32 MiB last-level cache
    assert layer_weights(config) == weights
    assert sample_layer_count(config) == layers


@pytest.mark.parametrize("kept", ["fast", [], ["x"], [{"dtype": "float32"}],
                                  [{"dtype": "float32", "threads": 1, "tokens_per_s": "fast", "sessions": 1}],
                                  [{"dtype": "float32", "threads": 1, "tokens_per_s": 9.0, "sessions": 1, "x": 2}]])
def test_a_damaged_calibration_is_measured_again_not_a_crash(tiny_model_path, tmp_path, monkeypatch, kept):
    from meshnet.models.hosttimings import host_id
    from meshnet.node import calibration

    monkeypatch.setenv("MESHNET_CACHE", str(tiny_model_path("tiny-llama").parent.parent))
    measured = [Sample("float32", 1, 60.0, 1), Sample("float32", 1, 300.0, 8), Sample("bfloat16", 1, 99.0, 1),
                Sample("bfloat16", 1, 200.0, 8)]
    monkeypatch.setattr(calibration, "measure", lambda *args, **kwargs: measured)
    cache = tmp_path / "calibration.json"
    key = f"{host_id()}|{host_key('tiny-llama', ['float32', 'bfloat16'], [1])}"
    cache.write_text(json.dumps({key: {"measured_at": 1000.0, "value": kept}}))
    choice = calibrate("tiny-llama", 1, cache_file=cache, now=2000.0)
    assert (choice.compute_dtype, choice.threads) == ("float32", 1) and "measured now" in choice.reason
    assert json.loads(cache.read_text())[key]["value"][0] == {"dtype": "float32", "threads": 1, "tokens_per_s": 60.0,
                                                              "sessions": 1}
