"""The path of one decode token (bench/token_path.py's trace): three real node processes, every
call into a ``meshnet/`` file recorded, a streamed chat straight to the entry.

Between two content chunks of steady decode the three processes together run at most
:data:`MAX_FILES` files (issue 24; ADR-0055 says which and why), and no module
of ``node/`` calls up into ``gateway/``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
#: the most distinct files a steady decode token may run through (issue 24; ADR-0055 lists them): 12,
#: then 15 with speculative decoding (ADR-0058): ``gateway/speculation.py`` drafts every step, and
#: the KV caches and the session store left ``kernels.py`` and ``runtime.py`` for ``models/caches.py``
#: and ``node/sessions.py`` (the same code, in modules kept within 450 lines); then 16 with step
#: receipts (ADR-0067, ADR-0055's amendment): every hop signs each step in ``dataplane/receipts.py``
MAX_FILES = 16


def load_bench():
    spec = importlib.util.spec_from_file_location("token_path", ROOT / "bench" / "token_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_steady_decode_token_runs_through_few_files_and_never_from_node_up_to_gateway(real_model_path,
                                                                                        monkeypatch):
    monkeypatch.chdir(ROOT)  # the nodes run `python -m bench.traced_meshnet`
    bench = load_bench()
    events, sent, arrivals = bench.trace(tokens=16)
    assert len(arrivals) == 16
    # a steady token: of the windows between chunks 8..13, the one with the fewest files (a heartbeat,
    # every 5 s, may fall into one window of tens of milliseconds and add the agent's files)
    windows = [(arrivals[i], arrivals[i + 1]) for i in range(8, 13)]
    steady = min(windows, key=lambda w: len(set().union(*bench.files_in(events, *w).values())))
    files = sorted(set().union(*bench.files_in(events, *steady).values()))
    first = sorted(set().union(*bench.files_in(events, sent, arrivals[0]).values()))
    print(f"steady decode token: {len(files)} files: {' '.join(files)}")
    print(f"first token: {len(first)} files")
    assert bench.upward_calls(events, *steady) == []
    assert len(files) <= MAX_FILES, files
    assert {"meshnet/dataplane/chain.py", "meshnet/dataplane/transport.py", "meshnet/models/shard.py"} <= set(files)
