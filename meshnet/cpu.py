"""Where per-request CPU work runs: a small thread pool of its own, off the event loop.

Parsing big bodies, rendering and tokenizing prompts and serialising big responses run here,
not on the event loop (which must keep answering health checks and sending heartbeats) and
not in the default executor, which runs shard forwards: a burst of huge requests then queues
behind itself instead of delaying every session's hop compute.
"""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

#: workers for request CPU work: tokenizers release the GIL, so a few run in parallel
REQUEST_WORKERS = min(4, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(max_workers=REQUEST_WORKERS, thread_name_prefix="meshnet-request")


async def off_loop(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` in the request pool, awaited without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))
