"""Named numpy columns indexed by sequence id.

Sequence ids are small recycled integers (engine/scheduler.py), so per-sequence settings live in
numpy columns indexed by id and a step reads its batch with one fancy index per column, whatever
the batch and whatever the context length. The engine (first-token times, logprob bookkeeping) and
the runner's sampling state each keep their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class RowColumns:
    """Named numpy columns indexed by sequence id, grown together (doubling) and reset to their
    defaults when a row is (re)used. Columns are plain attributes: `cols.temperature[sids]`."""

    def __init__(self, columns: dict[str, tuple[Any, Any]], capacity: int = 256) -> None:
        self._spec = columns  # name -> (dtype, default)
        self._size = capacity
        for name, (dtype, default) in columns.items():
            setattr(self, name, np.full(capacity, default, dtype=dtype))

    def reset(self, sid: int) -> None:
        """Row `sid` back to the defaults, growing every column if it is past the end."""
        if sid >= self._size:
            extra = max(sid + 1, 2 * self._size) - self._size
            for name, (dtype, default) in self._spec.items():
                setattr(self, name, np.concatenate([getattr(self, name), np.full(extra, default, dtype=dtype)]))
            self._size += extra
        for name, (_, default) in self._spec.items():
            getattr(self, name)[sid] = default

    def copy_row(self, src: int, dst: int) -> None:
        self.reset(dst)
        for name in self._spec:
            column = getattr(self, name)
            column[dst] = column[src]
