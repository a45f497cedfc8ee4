"""One measurement per host for the host's processes (meshnet.models.hosttimings, ADR-0048)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from meshnet.models import hosttimings, linears
from meshnet.models.hosttimings import remembered


def counter():
    calls = []

    def measure():
        calls.append(1)
        return {"chosen": "packed", "rows": [1, 8], "count": len(calls)}

    return calls, measure


def test_a_value_is_measured_once_then_read_until_it_expires(tmp_path):
    path = tmp_path / "timings.json"
    calls, measure = counter()
    first = remembered("layout|float32|1536x576|threads 1", measure, path=path, now=1000.0)
    assert first == ({"chosen": "packed", "rows": [1, 8], "count": 1}, True)
    assert remembered("layout|float32|1536x576|threads 1", measure, path=path, now=2000.0) == (first[0], False)
    (key, entry), = json.loads(path.read_text()).items()
    assert key == hosttimings.host_id() + "|layout|float32|1536x576|threads 1"
    assert entry == {"measured_at": 1000.0, "value": first[0]}
    assert remembered("layout|float32|1536x576|threads 2", measure, path=path, now=2000.0)[0]["count"] == 2
    expired = remembered("layout|float32|1536x576|threads 1", measure, path=path, now=1000.0 + hosttimings.TTL_S)
    assert expired == ({"chosen": "packed", "rows": [1, 8], "count": 3}, True) and len(calls) == 3


def test_off_measures_in_every_call_and_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(hosttimings.ENV, "off")
    calls, measure = counter()
    assert remembered("k", measure)[1] and remembered("k", measure)[1] and len(calls) == 2
    monkeypatch.setenv(hosttimings.ENV, str(tmp_path / "elsewhere.json"))
    assert remembered("k", measure) == ({"chosen": "packed", "rows": [1, 8], "count": 3}, True)
    assert remembered("k", measure)[1] is False and (tmp_path / "elsewhere.json").exists()


def test_a_damaged_or_unwritable_file_costs_a_measurement_not_an_error(tmp_path):
    path = tmp_path / "timings.json"
    path.write_text("{not json")
    calls, measure = counter()
    assert remembered("k", measure, path=path)[1] and len(calls) == 1
    assert remembered("k", measure, path=path)[1] is False  # written over
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert remembered("k", measure, path=blocked / "timings.json")[0]["count"] == 2  # its directory is a file


def test_a_measurement_may_ask_for_another_value_inside_it(tmp_path):
    path = tmp_path / "timings.json"
    out = []

    def outer():
        return remembered("inner", lambda: 7, path=path)[0] + 1  # the calibration's shards time their layouts

    worker = threading.Thread(target=lambda: out.append(remembered("outer", outer, path=path)))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and out == [(8, True)]
    kept = {key.rsplit("|", 1)[1]: entry["value"] for key, entry in json.loads(path.read_text()).items()}
    assert kept == {"inner": 7, "outer": 8}


def test_processes_that_start_together_measure_once(tmp_path):
    path, log = tmp_path / "timings.json", tmp_path / "measured.log"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from meshnet.models.hosttimings import remembered

        def measure():
            with open({str(log)!r}, "a") as fh:
                fh.write("measured\\n")
            time.sleep(0.5)  # a timing: the other process waits for it instead of timing at once
            return "transposed"

        value, here = remembered("layout|bfloat16|576x1536|threads 1", measure, path=Path({str(path)!r}))
        print(value, here)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        outputs = sorted(p.communicate(timeout=60)[0].split() for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert log.read_text() == "measured\n"
    assert outputs == [["transposed", "False"], ["transposed", "False"], ["transposed", "True"]]


def test_a_weight_layout_timed_by_one_process_serves_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv(hosttimings.ENV, str(tmp_path / "timings.json"))
    timed = []
    samples = {"row": {1: 2.0, 8: 9.0}, "transposed": {1: 1.0, 8: 8.0}}
    monkeypatch.setattr(linears, "measure_layout", lambda dtype, shape: timed.append(shape) or samples)
    monkeypatch.delenv(linears.LAYOUT_ENV, raising=False)
    previous = torch.get_num_threads()
    linears.layout.cache_clear()
    try:
        torch.set_num_threads(1)
        assert linears.layout(torch.float32, (1536, 576)) == "transposed" and timed == [(1536, 576)]
        linears.layout.cache_clear()  # as a second process on the host
        assert linears.layout(torch.float32, (1536, 576)) == "transposed" and timed == [(1536, 576)]
        torch.set_num_threads(2)
        assert linears.layout(torch.float32, (1536, 576)) == "transposed" and len(timed) == 2  # another count
        kept = json.loads((tmp_path / "timings.json").read_text())
        (tmp_path / "timings.json").write_text(json.dumps({k: {**v, "value": "diagonal"} for k, v in kept.items()}))
        linears.layout.cache_clear()
        assert linears.layout(torch.float32, (1536, 576)) == "transposed" and len(timed) == 3  # no such layout
    finally:
        torch.set_num_threads(previous)
        linears.layout.cache_clear()


def test_a_stuck_lock_is_waited_for_once_and_kept_values_never_wait(tmp_path):
    import fcntl
    import time

    path = tmp_path / "timings.json"
    remembered("kept", lambda: "transposed", path=path)
    with open(tmp_path / "timings.json.lock", "a+") as holder:  # a process stopped while it measures
        fcntl.flock(holder, fcntl.LOCK_EX)
        start = time.monotonic()
        assert remembered("kept", lambda: "row", path=path, lock_wait_s=60) == ("transposed", False)
        assert time.monotonic() - start < 5  # read without the lock
        assert remembered("k", lambda: "row", path=path, lock_wait_s=0.3) == ("row", True)
        waited = time.monotonic() - start
        assert 0.3 <= waited < 10
        assert remembered("k2", lambda: "packed", path=path, lock_wait_s=60) == ("packed", True)
        assert time.monotonic() - start - waited < 5  # this process waits for that lock no more
    assert remembered("k", lambda: "packed", path=path) == ("row", False)  # kept all the same


@pytest.mark.parametrize("measured_at", ["yesterday", None, True, 10_000.0])  # 10,000: after `now`
def test_a_kept_value_without_a_usable_time_is_measured_again_and_replaced(tmp_path, measured_at):
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({hosttimings.host_id() + "|k": {"measured_at": measured_at, "value": "diagonal"}}))
    (shown,) = hosttimings.entries([path], now=5000.0)
    assert shown["expired"] and shown["value"] == "diagonal"
    assert remembered("k", lambda: "row", path=path, now=5000.0) == ("row", True)
    assert remembered("k", lambda: "packed", path=path, now=5001.0) == ("row", False)  # replaced


def test_a_kept_value_this_host_cannot_use_is_measured_again_and_replaced(tmp_path, caplog):
    path = tmp_path / "timings.json"
    usable = ("row", "transposed").__contains__
    remembered("k", lambda: "diagonal", path=path, now=1.0)  # as a hand edit would leave it
    with caplog.at_level("WARNING"):
        assert remembered("k", lambda: "row", path=path, now=2.0, valid=usable) == ("row", True)
    assert "holds 'diagonal', which this host cannot use" in caplog.text
    assert remembered("k", lambda: "transposed", path=path, now=3.0, valid=usable) == ("row", False)


def test_the_environment_names_a_file_a_directory_or_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(hosttimings.ENV, "~/timings.json")
    assert hosttimings.default_path() == tmp_path / "timings.json"
    monkeypatch.setenv(hosttimings.ENV, str(tmp_path))
    assert hosttimings.default_path() == tmp_path / hosttimings.FILE
    monkeypatch.setenv(hosttimings.ENV, "OFF")
    assert hosttimings.default_path() is None
