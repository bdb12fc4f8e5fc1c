"""What the engine produced for a group of requests that its consumer has not taken yet.

The engine does not wait for consumers: a client that stops reading its stream would otherwise
have every token of its completion (and its logprobs) buffered here. So the buffer is bounded in
both size and age: once it holds more than its capacity, or its oldest unread output waited longer
than the stall timeout, the owner aborts the requests (see `AsyncLLMEngine._deliver`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from nanovllm.outputs import RequestOutput

# Per engine request of the group, in buffered entries (a token, or one of its logprobs): 65,536
# entries are over 3,000 tokens of lag at logprobs=20, and a few MB of Python objects.
DEFAULT_ENTRIES_PER_REQUEST = 1 << 16


def output_cost(out: RequestOutput) -> int:
    """Buffered entries an output holds: each new token plus each of its logprobs."""
    cost = 0
    for c in out.outputs:
        cost += len(c.token_ids) + sum(len(entry) for entry in c.logprobs or ())
    return cost


@dataclass
class OutputBuffer:
    request_ids: list[str]
    capacity: int  # in entries (see output_cost)
    _items: deque[tuple[RequestOutput | BaseException, int]] = field(default_factory=deque)
    _cost: int = 0
    # Monotonic time since which unread outputs wait: the first one's arrival, or the last take.
    _unread_since: float | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: RequestOutput | BaseException) -> None:
        cost = output_cost(item) if isinstance(item, RequestOutput) else 0
        if not self._items:
            self._unread_since = time.monotonic()
        self._items.append((item, cost))
        self._cost += cost
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Drops what is unread (nobody will see it) and leaves only `error` to be taken."""
        self._items.clear()
        self._cost = 0
        self.put(error)

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item, cost = self._items.popleft()
        self._cost -= cost
        self._unread_since = time.monotonic() if self._items else None
        return item

    def stall(self, stall_timeout: float | None) -> str | None:
        """Why the consumer counts as stalled (too much unread, or unread too long), or None."""
        if self._cost > self.capacity:
            return f"more than {self.capacity} unread tokens and logprobs"
        if stall_timeout is not None and self._unread_since is not None:
            waited = time.monotonic() - self._unread_since
            if waited > stall_timeout:
                return f"no output taken for {waited:.1f} s (the limit is {stall_timeout:g} s)"
        return None
