"""What a timing on this host found, kept for the host's other processes (ADR-0048's host amendment).

A node chooses its weight layouts (:func:`meshnet.models.linears.layout`), its float32 crossover
(:func:`~meshnet.models.linears.min_rows`) and its attention path
(:func:`meshnet.models.linears.attention_in_float32`) by timing kernels, and its compute dtype and
threads by timing decode steps (:mod:`meshnet.node.calibration`). Node processes that start
together time the same kernels at the same moment, each slowing the others, and may then choose
different layouts for the same weight (ADR-0048's host amendment).

:func:`remembered` makes one measurement per host serve them all. The first process that needs
a value takes an exclusive lock on the host's file (``fcntl.flock``), measures while the others
wait for the lock instead of competing for the cores, and writes the value; the others then
read it. Values are kept :data:`TTL_S` and keyed by the CPU, the torch version and what the
caller names (dtype, shape, thread count…). ``MESHNET_HOST_TIMINGS`` names another file, or
``off`` to measure in every process and keep nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

try:
    import fcntl
except ImportError:  # not POSIX: each process measures for itself, the file still serves later starts
    fcntl = None

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the host's timings file, under :func:`meshnet.models.sources.cache_dir`
FILE = "host-timings.json"
#: environment override: ``off``, or the path of the file to keep the timings in
ENV = "MESHNET_HOST_TIMINGS"
#: a value is trusted this long, seconds (a week: the calibration's own lifetime, ADR-0044)
TTL_S = 7 * 86_400.0
#: the longest wait for another process's measurement, seconds; past it this one measures
#: without the lock (the holder may be stopped: SIGSTOP keeps a lock, only exit frees it)
LOCK_WAIT_S = 120.0

#: how a log line names a value read from the host's file
KEPT = f"kept in {FILE}; `meshnet node timings --clear` or {ENV}=off measures again"

_process_lock = threading.RLock()  # one measurement at a time in this process; re-entrant (a
_held: list = []                   # calibration's sample shards time their layouts inside it)


def _cpuinfo() -> tuple[str | None, set[str]]:
    """The first CPU's model name and flags in ``/proc/cpuinfo`` (None and no flags where it
    cannot be read: not Linux)."""
    name, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name is None:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            if name is not None and flags:
                break
    except OSError:
        pass
    return name, flags


#: CPU flags that change which half-precision kernels run (``/proc/cpuinfo``): two CPUs of one
#: model name can differ in them (a name such as ``AMD EPYC`` covers several generations)
HALF_FLAGS = ("avx512_bf16", "avx512_fp16", "avx_ne_convert", "amx_bf16", "amx_fp16")


@functools.cache
def host_id() -> str:
    """What a timing depends on besides its own arguments: the CPU (model name, else what
    :mod:`platform` says; the kernels torch dispatches to; its half-precision flags) and the torch
    version. Read once per process."""
    import torch

    name, flags = _cpuinfo()
    name = name or platform.processor() or platform.machine()
    half = ",".join(f for f in HALF_FLAGS if f in flags) or "none"
    return f"{name}|{torch.backends.cpu.get_cpu_capability()} half {half}|torch {torch.__version__}"


def default_path() -> Path | None:
    """The host's timings file, or None where :data:`ENV` is ``off``. :data:`ENV` may name a file
    (``~`` expanded) or a directory (the file :data:`FILE` in it)."""
    forced = os.environ.get(ENV, "").strip()
    if forced.lower() == "off":
        return None
    if forced:
        path = Path(forced).expanduser()
        return path / FILE if path.is_dir() else path
    from meshnet.models.sources import cache_dir

    return cache_dir() / FILE


_MISSING = object()  # no usable value kept
_gave_up: set[Path] = set()  # lock files this process stopped waiting for (a stuck holder)
_warned: set[tuple[Path, str]] = set()  # (file, what) warned about once already


def _warn_once(path: Path, what: str, message: str, *args) -> None:
    if (path, what) not in _warned:
        _warned.add((path, what))
        log.warning(message, *args)


def remembered(key: str, measure: Callable[[], T], *, path: Path | None = None, now: float | None = None,
               ttl_s: float = TTL_S, lock_wait_s: float = LOCK_WAIT_S,
               valid: Callable[[object], bool] | None = None) -> tuple[T, bool]:
    """The value this host keeps for ``key`` (prefixed with :func:`host_id`), else ``measure()``,
    kept for the host's other processes. Returns ``(value, measured_here)``.

    A kept value is read without waiting (the file is replaced whole, never written in place).
    To measure, a process takes an exclusive lock on the file, waiting at most ``lock_wait_s``
    (once per process: after a wait runs out, it measures without the lock from then on), and
    reads again under it, so processes that start together measure once. ``measure`` may itself
    call :func:`remembered`. A value must survive JSON (strings, numbers, None, lists, dicts).

    Args:
        path: the file (default :func:`default_path`; None there: measure, keep nothing).
        now: the time, seconds since the epoch (default: the clock); a value measured more than
            ``ttl_s`` before it, after it, or at a time that is not a number is measured again.
        valid: whether a kept value can be used (a layout this host can store, a row count…);
            one that cannot is measured again and replaced, with a warning.

    Raises:
        Whatever ``measure`` raises. A file that cannot be read is measured over; one that cannot
        be written is logged (once per file) and left.
    """
    path = path or default_path()
    if path is None:
        return measure(), True
    full = f"{host_id()}|{key}"
    now = time.time() if now is None else now
    kept = _usable(path, key, read(path).get(full), now, ttl_s, valid)
    if kept is not _MISSING:
        return kept, False
    with _process_lock:
        opened = _take_lock(path, lock_wait_s) if not _held else None
        _held.append(opened)
        try:
            kept = _usable(path, key, read(path).get(full), now, ttl_s, valid)  # measured while this one waited
            if kept is not _MISSING:
                return kept, False
            value = measure()
            try:
                write(path, full, {"measured_at": now, "value": value})
            except (OSError, TypeError, ValueError) as exc:
                _warn_once(path, "write", "host timings not kept in %s (%s): every process measures them", path, exc)
            return value, True
        finally:
            _held.pop()
            if opened is not None:
                opened.close()


def _usable(path: Path, key: str, entry: object, now: float, ttl_s: float, valid) -> object:
    """``entry``'s value where it can be used, else :data:`_MISSING` (a warning says why, unless
    it is simply missing or old)."""
    if not isinstance(entry, dict) or "value" not in entry:
        if entry is not None:
            log.warning("host timing %s in %s is not an entry (%r): measured again", key, path, entry)
        return _MISSING
    measured_at = _time_of(entry)
    if measured_at is None or measured_at > now:
        log.warning("host timing %s in %s has no usable time (%r): measured again", key, path,
                    entry.get("measured_at"))
        return _MISSING
    if now - measured_at >= ttl_s:
        return _MISSING
    if valid is not None and not valid(entry["value"]):
        log.warning("host timing %s in %s holds %r, which this host cannot use: measured again", key, path,
                    entry["value"])
        return _MISSING
    return entry["value"]


def _time_of(entry: dict) -> float | None:
    """When ``entry`` was measured, seconds since the epoch; None where that is not a number."""
    measured_at = entry.get("measured_at")
    return None if isinstance(measured_at, bool) or not isinstance(measured_at, (int, float)) else measured_at


def _take_lock(path: Path, wait_s: float):
    """The open lock file of ``path``, locked (closing it unlocks), or None where no lock could
    be taken: no ``fcntl``, an unwritable directory, or a holder that kept it past ``wait_s``
    (then this process no longer waits for that lock)."""
    if fcntl is None or path in _gave_up:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        opened = open(path.with_name(path.name + ".lock"), "a+")
    except OSError as exc:
        _warn_once(path, "lock", "host timings lock of %s not taken (%s): going on without it", path, exc)
        return None
    if _lock(opened, wait_s):
        return opened
    opened.close()
    _gave_up.add(path)
    log.warning("host timings %s: still locked after %.0f s (its holder may be stopped); this process measures "
                "without the lock from now on", path, wait_s)
    return None


def _lock(opened, wait_s: float) -> bool:
    """Take an exclusive ``flock`` on ``opened`` (released when it closes), trying every 20 ms
    for at most ``wait_s`` seconds; whether it was taken."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(opened, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def read(path: Path) -> dict:
    """The file's entries: an empty dict where it is missing, and where it is not a JSON object
    (a warning then says it will be replaced)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        _warn_once(path, "damaged", "host timings file %s is not a JSON object: its values are measured again "
                   "and it is replaced", path)
        return {}
    return data


def write(path: Path, key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` (replace, then rename: a concurrent reader sees old or new).

    Raises:
        OSError: the directory cannot be written; TypeError, ValueError: ``entry`` is not JSON.
    """
    data = read(path)
    data[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def entries(paths: list[Path], now: float | None = None) -> list[dict]:
    """Every value kept in ``paths`` for this host (:func:`host_id`), oldest first: ``file``,
    ``kind`` (``layout``, ``min_rows``, ``attention in float32``, ``calibration``), ``what`` (the
    rest of its key: dtype, shape, thread count…), ``value``, ``measured_at`` and ``age_s``
    (seconds; None where the time is not a number), and ``expired`` (older than :data:`TTL_S`, in
    the future, or with no time: measured again at the next start). Entries of other CPUs or
    torch versions are left out."""
    now = time.time() if now is None else now
    prefix = host_id() + "|"
    out = []
    for path in paths:
        for key, entry in read(path).items():
            if not key.startswith(prefix) or not isinstance(entry, dict):
                continue
            kind, _, what = key[len(prefix):].partition("|")
            measured_at = _time_of(entry)
            age_s = None if measured_at is None else round(now - measured_at, 1)
            out.append({"file": str(path), "kind": kind, "what": what.replace("|", " "), "value": entry.get("value"),
                        "measured_at": measured_at, "age_s": age_s, "expired": age_s is None or not 0 <= age_s < TTL_S})
    return sorted(out, key=lambda e: e["measured_at"] or 0.0)

