"""Per-sequence vocabulary-wide rows (penalty counts, logit bias) in one device tensor with a free
list of slots (`DenseRows`), beside the sampling state's numpy columns (nanovllm/row_columns.py):
a step touches a batch's rows with one fancy index instead of a Python loop over sequences.
"""

from __future__ import annotations

import torch


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
