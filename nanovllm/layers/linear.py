"""Linear layers with per-parameter weight loaders.

Tensor parallelism is size 1 for now, but the layers keep the column/row split of vLLM so that
sharding only has to be added in the weight loaders (narrow the loaded tensor) and an all-reduce
after `RowParallelLinear`. Every parameter carries a `weight_loader(param, loaded, shard_id=None)`
attribute; the checkpoint loader calls it, so packed layers (q/k/v, gate/up) can place each
checkpoint tensor at its offset inside the fused weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

ShardId = str | int | None


class WeightLoader(Protocol):
    def __call__(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None: ...


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
) -> None:
    """Copy a whole tensor into `param` (converting dtype); ValueError on a shape mismatch."""
    if shard_id is not None:
        raise ValueError(f"parameter is not packed, got shard id {shard_id!r}")
    check_shape(param.shape, loaded.shape)
    with torch.no_grad():
        param.copy_(loaded)


def check_shape(expected: Sequence[int], got: Sequence[int]) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"shape mismatch: expected {list(expected)}, got {list(got)}")


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W `[output_size, input_size]`, as in nn.Linear and HF checkpoints."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output dimension split across tensor-parallel ranks (size 1 here)."""


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; outputs would be all-reduced (size 1 here)."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul.

    Shard ids are indices into `output_sizes` (gate_proj -> 0, up_proj -> 1).
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard id must be an index < {len(self.output_sizes)}, got {shard_id!r}"
            )
        offset = sum(self.output_sizes[:shard_id])
        _load_rows(param, loaded, offset, self.output_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused: output rows are [q heads | k heads | v heads]."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        offsets = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        if shard_id not in offsets:
            raise ValueError(f"shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        offset, size = offsets[shard_id]  # type: ignore[index]
        _load_rows(param, loaded, offset, size)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


def _load_rows(param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int) -> None:
    """Copy `loaded` into rows offset:offset+size of a packed weight (dim 0) or bias."""
    expected = (size, *param.shape[1:])
    check_shape(expected, loaded.shape)
    with torch.no_grad():
        param.narrow(0, offset, size).copy_(loaded)
