"""``meshnet`` with every Python call into a ``meshnet/`` file recorded, for ``bench/token_path.py``.

Run as ``python -m bench.traced_meshnet <meshnet args>`` (``LocalMesh.start_node(module=...)``).
The profile hook is set for this thread and every thread started later, before the CLI starts
any. Each call into a ``meshnet/`` file is kept as ``(wall-clock seconds, callee file, caller
file, callee function)`` in a bounded buffer; SIGUSR1 writes the buffer to ``$MESHNET_TRACE_DIR/<pid>.json``.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

PACKAGE = str(Path(__file__).resolve().parent.parent / "meshnet") + os.sep
#: calls kept (the newest): a few seconds of decode on a three-hop mesh
MAX_EVENTS = 2_000_000

_events: collections.deque = collections.deque(maxlen=MAX_EVENTS)
_ours: dict[object, str | None] = {}  # code object -> its meshnet-relative file, or None


def _file_of(code) -> str | None:
    name = _ours.get(code, False)
    if name is False:
        path = code.co_filename
        name = path[len(PACKAGE) - len("meshnet/"):] if path.startswith(PACKAGE) else None
        _ours[code] = name
    return name


def _hook(frame, event, arg) -> None:
    if event != "call":
        return
    callee = _file_of(frame.f_code)
    if callee is None:
        return
    caller = frame.f_back
    _events.append((time.time(), callee, _file_of(caller.f_code) if caller is not None else None,
                    frame.f_code.co_qualname))


def _dump(signum, frame) -> None:
    out = Path(os.environ["MESHNET_TRACE_DIR"]) / f"{os.getpid()}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(list(_events)))
    tmp.replace(out)


def main() -> None:
    signal.signal(signal.SIGUSR1, _dump)
    threading.setprofile(_hook)
    sys.setprofile(_hook)
    from meshnet.cli.main import app

    sys.argv[0] = "meshnet"
    app()


if __name__ == "__main__":
    main()
