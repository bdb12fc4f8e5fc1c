"""Integers of 4 or 8 bits packed into int32 words, as every supported checkpoint format stores them
(each with its own dimension and, for AWQ, its own order of the values inside a word)."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, size: int, order: list[int] | None = None) -> torch.Tensor:
    """The unsigned values (int32) of `packed` along `dim`, cut to `size` there. Value i of a word
    sits in bits [i * bits, (i + 1) * bits); with `order`, value i of word j is element
    j * per_word + order[i] (AWQ interleaves its columns)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = packed.to(torch.int32).movedim(dim, -1)
    values = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    if order is not None:
        values = values[..., torch.argsort(torch.tensor(order))]
    values = values.flatten(-2)[..., :size]
    return values.movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `values` (< 2^bits) packed along `dim` in sequential order, zero-padded to whole words."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    pad = -v.shape[-1] % per_word
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.unflatten(-1, (-1, per_word)) << torch.arange(0, 32, bits, dtype=torch.int64)
    words = v.sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()
