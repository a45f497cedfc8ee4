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


def test_serve_on_a_port_in_use_fails_before_anything_is_written(tmp_path, monkeypatch):
    """A second `meshnet serve` on the port of a running one would answer READY for the first one's
    mesh and overwrite its operator token file: it exits 1 at once instead."""
    import socket

    from typer.testing import CliRunner

    from meshnet.cli.main import app

    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--port", str(port), "--model", "tiny-llama"])
    assert result.exit_code == 1
    assert f"port {port} is in use" in result.output and "another meshnet serve" in result.output
    assert list(tmp_path.iterdir()) == []  # no token file, no model fetched


def test_a_stop_signal_delivered_twice_at_once_is_one_stop_and_a_later_one_is_a_second():
    """A process-group SIGTERM reaches serve twice when a wrapper (timeout, make) relays it: the
    drain must not turn into a kill. A signal after DUPLICATE_SIGNAL_S is a second Ctrl-C."""
    import os
    import signal
    import time

    import pytest

    from meshnet.cli import serve

    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        serve._stop_on_signals()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)  # the same stop again, at once: ignored
        time.sleep(0.1)
        time.sleep(serve.DUPLICATE_SIGNAL_S)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])
