"""The server's tokenizer work (tokenize, detokenize, chat-template rendering) in a small thread
pool, so that a multi-megabyte prompt or a slow template never stalls the event loop: /health and
every stream keep going while it runs.

The tokenizer is shared by the pool's threads. That is safe for what runs here: a fast tokenizer's
encode and decode only read it (its truncation and padding settings, the one mutable part, are
never touched), and the engine never uses it (it detokenizes with its own token table).

Rendering runs under a deadline. Python cannot stop a thread from outside, so the render thread
traces itself: Jinja compiles a template to Python code (file name "<template>"), and every line
it runs, or any function it calls, checks the clock and raises past the deadline. A template
that loops for ever therefore ends with RenderTimeoutError after `timeout` seconds.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

# Enough that one slow render does not hold up every other request's tokenization; few, since
# these threads compete with the engine thread for the CPU (and the GIL).
DEFAULT_THREADS = 4

_JINJA_FILENAME = "<template>"


class RenderTimeoutError(Exception):
    pass


def run_with_deadline(fn: Callable[[], T], timeout: float) -> T:
    """fn() in this thread, raising RenderTimeoutError once it runs longer than `timeout` seconds
    inside Jinja template code (or in functions that code calls)."""
    deadline = time.monotonic() + timeout

    def check(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise RenderTimeoutError(f"rendering the chat template took longer than {timeout:g} s")
        # Line events only inside templates: elsewhere the calls are enough, and much cheaper.
        return check if frame.f_code.co_filename == _JINJA_FILENAME else None

    sys.settrace(check)
    try:
        return fn()
    finally:
        sys.settrace(None)


class TextWorkers:
    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nanovllm-text")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
