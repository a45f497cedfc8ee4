"""The Typer CLI: --json output, argument errors to stderr with a non-zero exit."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from meshnet.cli.main import app

runner = CliRunner()


def test_models_list_json_names_the_presets():
    result = runner.invoke(app, ["models", "list", "--json"])
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["smollm2-135m-instruct"]["num_layers"] == 30 and rows["smollm2-135m-instruct"]["default"]
    assert rows["tiny-gpt2"]["family"] == "gpt2"


def test_shard_flags_go_together():
    result = runner.invoke(app, ["node", "start", "--shard-start", "5"])
    assert result.exit_code == 1
    assert "--shard-start and --shard-end go together" in result.output


def test_model_without_shard_needs_a_tracker():
    result = runner.invoke(app, ["node", "start", "--model", "tiny-llama"])
    assert result.exit_code == 1
    assert "--model without a shard needs --tracker" in result.output


def test_unreachable_tracker_is_a_clean_error():
    result = runner.invoke(app, ["nodes", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "cannot reach http://127.0.0.1:9" in result.output


def test_serve_needs_at_least_one_node():
    result = runner.invoke(app, ["serve", "--nodes", "0"])
    assert result.exit_code == 2  # Typer: --nodes must be >= 1


def test_local_doctor_reports_json_for_a_recipe(tmp_path):
    result = runner.invoke(app, ["doctor", "--model", "tiny-llama", "--shard", "1-2", "--quantization", "int8",
                                 "--json"], env={"MESHNET_CACHE": str(tmp_path)})
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)[0]
    assert (report["model"], report["shard_start"], report["shard_end"]) == ("tiny-llama", 1, 2)
    assert report["passed"] and report["recipe"] == {"quantization": "int8", "compute_dtype": "bfloat16"}
    assert report["tokens_per_s"] > 0 and len(report["weights_digest"]) == 32
    assert report["resident_bytes"] > 0   # the shard's measured memory (ADR-0039)


def test_ready_exits_1_with_the_reasons_and_json(monkeypatch):
    from meshnet.client import TrackerClient

    body = {"ready": False, "reasons": ["smollm2-135m-instruct: coverage gap at layers 10-19"], "models": []}

    async def fake_ready(self, model=None):
        return body

    monkeypatch.setattr(TrackerClient, "ready", fake_ready)
    human = runner.invoke(app, ["ready", "--url", "http://tracker.test"])
    assert human.exit_code == 1
    assert "not ready" in human.stdout and "coverage gap at layers 10-19" in human.stdout
    as_json = runner.invoke(app, ["ready", "--url", "http://tracker.test", "--json"])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout) == body
    body = {"ready": True, "reasons": [], "models": []}
    assert runner.invoke(app, ["ready", "--url", "http://tracker.test"]).exit_code == 0


def test_ready_of_an_unreachable_node_is_a_clean_error():
    result = runner.invoke(app, ["ready", "--node", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "cannot reach http://127.0.0.1:9" in result.output


def test_nodes_marks_a_draining_node(monkeypatch):
    from meshnet.client import TrackerClient

    row = {"node_id": "mid-a", "endpoint": "http://m:1", "memory_budget_bytes": 1 << 30, "max_assignable_layers": {},
           "slots_used": 1, "slots_total": 1, "shards": [], "stats": {"tokens_per_s": 0.0}, "last_heartbeat_age_s": 1.0,
           "reason": "", "draining": True}

    async def fake_nodes(self):
        return [row]

    monkeypatch.setattr(TrackerClient, "nodes", fake_nodes)
    result = runner.invoke(app, ["nodes", "--url", "http://tracker.test"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "mid-a (draining)" in result.stdout


def _chat_answer(monkeypatch, response) -> None:
    """Make ``meshnet chat``'s HTTP calls (plain and streamed) get ``response``."""
    import meshnet.cli.ops as ops

    monkeypatch.setattr(ops.httpx, "post", lambda *a, **kw: response)

    class Stream:
        def __enter__(self):
            return response

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(ops.httpx, "stream", lambda *a, **kw: Stream())


def test_chat_with_an_out_of_range_seed_prints_one_error_line(monkeypatch):
    import httpx

    seed = str(2**64)
    message = f"invalid field 'seed': seed must lie in [0, 2**63 - 1] = [0, {2**63 - 1}], got {seed}"
    _chat_answer(monkeypatch, httpx.Response(400, json={"error": {"message": message, "type": "invalid_request_error",
                                                                   "code": "invalid_field", "param": "seed"}}))
    for stream in ("--stream", "--no-stream"):
        result = runner.invoke(app, ["chat", "hi", "--model", "tiny-llama", "--seed", seed, stream])
        assert result.exit_code == 1
        assert result.output.strip().splitlines() == [f"error: {message}"]


def test_chat_against_a_server_error_in_plain_text_is_no_traceback(monkeypatch):
    import httpx

    _chat_answer(monkeypatch, httpx.Response(500, text="Internal Server Error"))
    for stream in ("--stream", "--no-stream"):
        result = runner.invoke(app, ["chat", "hi", "--model", "tiny-llama", stream])
        assert result.exit_code == 1
        assert result.output.strip().splitlines() == ["error: HTTP 500: Internal Server Error"]
        assert result.exception is None or isinstance(result.exception, SystemExit)


TRAFFIC = {
    "at_s": 1000.0,
    "nodes": [{"node_id": "n1", "at_s": 1000.0, "bucket_s": 10.0, "error": None, "sessions": [], "failovers": [],
               "kv_sessions": 1,
               "buckets": [{"start_s": 990.0, "ttft_s": 0.25, "first_tokens": 2, "tpot_s": 0.04, "finished": 1,
                            "forward_tokens": 120, "batch_size": 1.5, "batch_size_max": 2, "forwards": 4}]},
              {"node_id": "n2", "at_s": 1000.0, "bucket_s": 10.0, "error": "GET http://n2/v1/traffic timed out",
               "buckets": [], "sessions": [], "failovers": []}],
    "sessions": [{"session_id": "abcdef0123456789", "model": "smollm2-135m", "entry_node": "n1",
                  "route": [{"node_id": "n1", "start_layer": 0, "end_layer": 14},
                            {"node_id": "n3", "start_layer": 15, "end_layer": 29}],
                  "prompt_tokens": 40, "completion_tokens": 7, "age_s": 2.5, "ttft_s": 0.31, "failovers": 1}],
    "failovers": [{"at_s": 988.0, "session_id": "abcdef0123456789", "entry_node": "n1", "failed_node": "n2",
                   "start_layer": 15, "end_layer": 29, "replacement": ["n3"], "reason": "n2 froze"}],
}


def test_traffic_prints_nodes_sessions_and_failovers_or_json(monkeypatch):
    from meshnet.client import TrackerClient

    async def fake_traffic(self, buckets=None):
        assert buckets == 6  # the last minute
        return TRAFFIC

    monkeypatch.setattr(TrackerClient, "traffic", fake_traffic)
    monkeypatch.setattr("meshnet.cli.traffic.time.time", lambda: 1000.0)
    result = runner.invoke(app, ["traffic", "--url", "http://tracker.test"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    n1 = next(line for line in lines if line.startswith("│ n1 "))
    assert [c.strip() for c in n1.split("│")[1:-1]] == ["n1", "1/1", "250 ms", "40 ms", "12.0", "1.50/2", "ok"]
    assert any("timed out" in line for line in lines if line.startswith("│ n2 "))
    session = next(line for line in lines if line.startswith("│ abcdef01 "))
    assert "n1[0-14] → n3[15-29]" in session and "40+7" in session and "310 ms" in session
    failover = next(line for line in lines if line.startswith("│ 12 s ago "))
    assert [c.strip() for c in failover.split("│")[1:-1]] == ["12 s ago", "abcdef01", "n1", "n2", "15-29", "n3",
                                                             "n2 froze"]
    as_json = runner.invoke(app, ["traffic", "--json", "--url", "http://tracker.test"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == TRAFFIC


def test_traffic_of_an_unreachable_tracker_is_a_clean_error():
    result = runner.invoke(app, ["traffic", "--url", "http://127.0.0.1:1"])
    assert result.exit_code == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("args, message", [
    (["--serve-layers", "5"], "--serve-layers: layer range must look like 'START-END'"),
    (["--serve-layers", "9-0"], "END must be >= START"),
    (["--serve-layers", "0-30"], "--serve-layers 0-30 is beyond smollm2-135m-instruct's 30 layers (the last is 29)"),
    (["--serve-layers", "0-9", "--dtype", "fast"], "--dtype must be auto, float32 or bfloat16, got 'fast'"),
    (["--serve-layers", "0-9", "--public-url", "ftp://x"], "scheme must be http or https"),
])
def test_tracker_serve_layers_errors_are_clear(args, message, tmp_path):
    result = runner.invoke(app, ["tracker", "start", "--db", str(tmp_path / "t.db"), *args],
                           env={"MESHNET_CACHE": str(tmp_path)})
    assert result.exit_code == 1
    assert message in " ".join(result.output.split())


def test_chat_moves_on_to_the_next_tracker_url(monkeypatch):
    import httpx

    from meshnet.cli import ops

    asked = []

    def post(url, **kw):
        asked.append(url)
        if url.startswith("http://t1"):
            raise httpx.ConnectError("[Errno 111] Connection refused")
        return httpx.Response(200, json={"choices": [{"message": {"content": "Paris"}}]})

    monkeypatch.setattr(ops.httpx, "post", post)
    result = runner.invoke(app, ["chat", "hi", "--model", "tiny-llama", "--no-stream",
                                 "--url", "http://t1:8700,http://t2:8700"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "Paris"
    assert asked == ["http://t1:8700/v1/chat/completions", "http://t2:8700/v1/chat/completions"]


def test_node_timings_shows_what_this_host_keeps_and_clear_forgets_it(tmp_path, monkeypatch):
    from meshnet.models.hosttimings import host_id, remembered
    from meshnet.node.calibration import Sample

    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path))
    monkeypatch.setenv("MESHNET_HOST_TIMINGS", str(tmp_path / "host-timings.json"))
    remembered("layout|float32|1536x576|threads 1|of row,transposed,packed", lambda: "packed", now=1000.0)
    remembered("attention in float32|bfloat16|threads 1", lambda: True, now=2000.0)
    samples = [Sample("bfloat16", 1, 99.0, 1).__dict__, Sample("bfloat16", 1, 571.0, 8).__dict__]
    remembered("calibration|tiny|bfloat16|1|sessions 1,8|layouts bfloat16:row", lambda: samples,
               path=tmp_path / "calibration.json", now=3000.0)
    remembered("min_rows|bfloat16|threads 1", lambda: 16, path=tmp_path / "host-timings.json")  # now: not expired
    shown = json.loads(runner.invoke(app, ["node", "timings", "--json"]).stdout)
    assert shown["host"] == host_id() and not shown["cleared"]
    assert [(t["kind"], t["what"], t["value"], t["expired"]) for t in shown["timings"]] == [
        ("layout", "float32 1536x576 threads 1 of row,transposed,packed", "packed", True),
        ("attention in float32", "bfloat16 threads 1", True, True),
        ("calibration", "tiny bfloat16 1 sessions 1,8 layouts bfloat16:row", samples, True),
        ("min_rows", "bfloat16 threads 1", 16, False)]
    table = runner.invoke(app, ["node", "timings"], env={"COLUMNS": "200"}).stdout
    assert "bfloat16 99 / 571 tok/s" in table and "1536x576 threads 1" in table and "(expired)" in table
    assert "from 16 rows" in table and "float32" in table
    kept = json.loads((tmp_path / "host-timings.json").read_text())  # as a hand edit might leave it
    (tmp_path / "host-timings.json").write_text(json.dumps({k: {"measured_at": "yesterday", "value": [1]}
                                                            for k in kept}))
    damaged = json.loads(runner.invoke(app, ["node", "timings", "--json"]).stdout)["timings"]
    assert [(t["age_s"], t["expired"]) for t in damaged if t["kind"] != "calibration"] == [(None, True)] * 3
    assert "?" in runner.invoke(app, ["node", "timings"], env={"COLUMNS": "200"}).stdout
    cleared = runner.invoke(app, ["node", "timings", "--clear", "--json"])
    assert cleared.exit_code == 0 and json.loads(cleared.stdout)["cleared"]
    assert not (tmp_path / "host-timings.json").exists() and not (tmp_path / "calibration.json").exists()
    assert json.loads(runner.invoke(app, ["node", "timings", "--json"]).stdout)["timings"] == []
