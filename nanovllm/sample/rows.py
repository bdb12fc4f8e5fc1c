"""Storage for per-sequence state that a step reads with one vectorized gather.

Sequence ids are small recycled integers (`SequenceIds`), so per-sequence settings live in numpy
columns indexed by id (`RowColumns`) and per-sequence vocabulary-wide rows (penalty counts, logit
bias) in one device tensor with a free list of slots (`DenseRows`). A step then touches a batch's
rows with a fancy index per column instead of a Python loop over sequences.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class SequenceIds:
    """Small, recycled integer ids for the core's sequences (they index the tables below)."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0

    def acquire(self) -> int:
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def release(self, sid: int) -> None:
        self._free.append(sid)


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


class DenseRows:
    """Rows of shape `row_shape` in one device tensor, handed out as slots (a sequence that needs a
    vocabulary-wide row takes one; most sequences never do). Slots are zeroed when acquired."""

    def __init__(self, row_shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.data = torch.zeros((0, *row_shape), dtype=dtype, device=device)
        self._free: list[int] = []

    def acquire(self) -> int:
        if not self._free:
            size = self.data.shape[0]
            extra = max(8, size)
            self.data = torch.cat([self.data, self.data.new_zeros((extra, *self.data.shape[1:]))])
            self._free.extend(range(size + extra - 1, size - 1, -1))
        slot = self._free.pop()
        self.data[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, slot: int) -> int:
        """A new slot holding the same row."""
        new = self.acquire()
        self.data[new] = self.data[slot]
        return new
