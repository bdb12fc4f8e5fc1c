"""The one in-memory form of a weight-only quantized `[out, in]` weight, whatever checkpoint format it
came from, its reference dequantization, and round-to-nearest quantization.

`W[:, perm[j]] = (q[:, j] - z[:, j // group_size]) * s[:, j // group_size]`: integers `q` in the
signed range of their bit width (int4 [-8, 7], int8 [-128, 127]), a scale per output row and group
of `group_size` consecutive columns (the last group may be shorter; `group_size == in_features`
means one per row: "channel"), an optional integer zero point per scale (None: 0, symmetric), and
for activation-ordered checkpoints (GPTQ desc_act, compressed-tensors actorder="group") the
permutation `perm` that sorts the input columns by group, so that groups are always contiguous. A
format's unsigned integers map here by subtracting 2^(bits-1) from both q and z (which leaves
q - z as it was).
"""

from __future__ import annotations

import dataclasses

import torch

BITS = (4, 8)


def signed_range(bits: int) -> tuple[int, int]:
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    qweight: torch.Tensor  # int8 [out, in], in the signed range of `bits`
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor | None  # int8 [out, groups] (int4 ones may reach 8: GPTQ's zero + 1), None: all 0
    bits: int
    group_size: int
    perm: torch.Tensor | None = None  # int64 [in]: column j of qweight is input column perm[j]

    def __post_init__(self) -> None:
        q, s, z = self.qweight, self.scales, self.zeros
        if self.bits not in BITS:
            raise ValueError(f"{self.bits}-bit weights are not supported (4 or 8)")
        if q.dtype != torch.int8 or q.dim() != 2 or q.shape[0] < 1 or q.shape[1] < 1:
            raise ValueError(f"quantized values must be a non-empty 2-D int8 tensor, got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if not 1 <= self.group_size <= k:
            raise ValueError(f"group size {self.group_size} for {k} input columns")
        groups = -(-k // self.group_size)
        if s.dtype != torch.float32 or tuple(s.shape) != (n, groups):
            raise ValueError(f"scales of shape {tuple(s.shape)} ({s.dtype}) for a [{n}, {k}] weight in groups of "
                             f"{self.group_size}: expected float32 [{n}, {groups}]")
        if z is not None and (z.dtype != torch.int8 or tuple(z.shape) != (n, groups)):
            raise ValueError(f"zero points of shape {tuple(z.shape)} ({z.dtype}): expected int8 [{n}, {groups}]")
        if self.perm is not None and (self.perm.dtype != torch.int64 or tuple(self.perm.shape) != (k,)):
            raise ValueError(f"column permutation of shape {tuple(self.perm.shape)}: expected int64 [{k}]")
        lo, hi = signed_range(self.bits)
        if self.bits < 8 and (int(q.min()) < lo or int(q.max()) > hi):
            raise ValueError(f"quantized values outside the {self.bits}-bit range [{lo}, {hi}]")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def groups(self) -> int:
        return self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The `[out, in]` weight, in the input's column order: (q - z) * s in fp32 (fp64 for
        `dtype` fp64), then `dtype`."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        q = self.qweight.to(work)
        if self.zeros is not None:
            q = q - self.zeros.to(work).repeat_interleave(self.group_size, dim=1)[:, :self.in_features]
        w = q * self.scales.to(work).repeat_interleave(self.group_size, dim=1)[:, :self.in_features]
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def stored_bytes(self, scale_bytes: int = 2) -> int:
        """Bytes of the weight at its stored precision: packed values, scales of `scale_bytes`, zero
        points of `bits` (what a decode step reads)."""
        n, groups = self.out_features, self.groups
        zeros = 0 if self.zeros is None else n * groups * self.bits // 8
        return n * self.in_features * self.bits // 8 + n * groups * scale_bytes + zeros


def unpacked(where: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group_size: int, perm: torch.Tensor | None = None) -> QuantizedWeight:
    """A checkpoint module's tensors as a QuantizedWeight: its own checks, which do not know the
    module, raise naming `where`."""
    try:
        return QuantizedWeight(qweight, scales, zeros, bits, group_size, perm)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The fused weight of shards stacked along the output dimension (q/k/v, gate/up): they must
    agree on bits, groups and column order."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.in_features) != (first.bits, first.group_size, first.in_features):
            raise ValueError(f"fused shards differ: {p.bits}-bit in groups of {p.group_size} over {p.in_features} "
                             f"columns vs {first.bits}-bit in groups of {first.group_size} over {first.in_features}")
        if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            raise ValueError("fused shards have different activation orders (g_idx); they must share one")
    if len(parts) == 1:
        return first
    # A shard without zero points next to one with them (GPTQ's sym=true drops a shard's when all sit
    # at the midpoint) takes explicit zeros: the same weights.
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([torch.zeros_like(p.scales, dtype=torch.int8) if p.zeros is None else p.zeros
                           for p in parts])
    return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), zeros,
                           first.bits, first.group_size, first.perm)


def permutation_from_g_idx(g_idx: torch.Tensor, group_size: int, what: str) -> torch.Tensor | None:
    """The column order that makes g_idx's groups contiguous (None when they already are), checking
    that every group holds group_size columns (the last one what is left)."""
    k = g_idx.numel()
    g = g_idx.to(torch.int64).flatten()
    expected = torch.arange(k) // group_size
    if torch.equal(g, expected):
        return None
    perm = torch.sort(g, stable=True).indices
    if not torch.equal(g[perm], expected):
        raise ValueError(f"{what}: g_idx does not split the {k} input columns into groups of {group_size}")
    return perm


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int | None, symmetric: bool,
                 scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of an `[out, in]` weight, as compressed-tensors' min-max observer
    does it: per group, the range [min(w, 0), max(w, 0)]; symmetric: s = max|w| / (2^bits - 1) * 2,
    z = 0; asymmetric: s = (max - min) / (2^bits - 1), z = round(qmin - min / s); q = clamp(round(w / s) + z).
    Scales are rounded to `scale_dtype` (the checkpoint's dtype, as a checkpoint stores them) before
    q is computed, so the stored scales are exactly the ones used. `group_size` None: one group per row."""
    if bits not in BITS:
        raise ValueError(f"{bits}-bit quantization is not supported (4 or 8)")
    n, k = weight.shape
    gs = k if group_size is None else group_size
    if gs < 1 or k % gs:
        raise ValueError(f"{k} input columns are not a multiple of the group size {gs}")
    w = weight.detach().float().reshape(n, k // gs, gs)
    lo, hi = signed_range(bits)
    wmin = w.amin(dim=2).clamp(max=0.0)
    wmax = w.amax(dim=2).clamp(min=0.0)
    dtype = scale_dtype or weight.dtype
    if symmetric:
        scales = torch.maximum(wmin.abs(), wmax) / ((hi - lo) / 2)
    else:
        scales = (wmax - wmin) / (hi - lo)
    scales = scales.to(dtype)
    scales = torch.where(scales == 0, torch.tensor(torch.finfo(dtype).eps, dtype=dtype), scales).float()
    zeros = None
    if not symmetric:
        zeros = torch.round(lo - wmin / scales).clamp(lo, hi)
    shifted = w / scales[..., None]
    if zeros is not None:
        shifted = shifted + zeros[..., None]  # before rounding, as compressed-tensors (ties to even)
    q = torch.round(shifted).clamp(lo, hi).to(torch.int8).reshape(n, k)
    z = None if zeros is None else zeros.to(torch.int8)
    return QuantizedWeight(q, scales.contiguous(), z, bits, gs)
