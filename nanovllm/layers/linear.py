"""Linear layers with per-parameter weight loaders, split Megatron-style across tensor-parallel ranks.

`ColumnParallelLinear` splits the output dimension (each rank computes its rows of y, no
communication), `RowParallelLinear` the input dimension (each rank computes a partial y from its
slice of x, summed over ranks with one all-reduce). A column-parallel layer followed by a
row-parallel one (q/k/v -> o, gate/up -> down) therefore needs one all-reduce per pair. With no
group (`tp=None`, one rank) every layer holds the whole weight and makes no collective call.

Every parameter carries a `weight_loader(param, loaded, shard_id=None)` attribute; the checkpoint
loader calls it with the checkpoint tensor, either a torch tensor or a safetensors slice (read
lazily: a loader reads only the rows or columns its rank keeps, never the whole tensor). Packed
layers (q/k/v, gate/up) place each checkpoint tensor at its offset inside the fused weight. Shape
errors name the checkpoint's full shapes, whatever this rank keeps of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from nanovllm.cpu import gemm as cpu_gemm

if TYPE_CHECKING:
    from nanovllm import _cpu
    from nanovllm.distributed.parallel_state import TPGroup
    from nanovllm.layers.quantization.linear_method import QuantizedLinear

ShardId = str | int | tuple[int, int] | None  # tuple: (expert, gate 0 / up 1) of a fused MoE
# A torch tensor or a safetensors slice (`safe_open(...).get_slice(name)`): shape and slicing.
Loaded = Any


class WeightLoader(Protocol):
    def __call__(
        self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None
    ) -> None: ...


def loaded_shape(loaded: Loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_part(loaded: Loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """`loaded[start:start+size]` along `dim` (0 or 1); from a safetensors slice only those bytes
    are read."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[start:start + size] if dim == 0 else loaded[:, start:start + size]


def read_all(loaded: Loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def default_weight_loader(
    param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None
) -> None:
    """Copy a whole tensor into `param` (converting dtype); ValueError on a shape mismatch."""
    if shard_id is not None:
        raise ValueError(f"parameter is not packed, got shard id {shard_id!r}")
    check_shape(param.shape, loaded_shape(loaded))
    with torch.no_grad():
        param.copy_(read_all(loaded))


def check_shape(expected: Sequence[int], got: Sequence[int]) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"shape mismatch: expected {list(expected)}, got {list(got)}")


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def tp_rank_size(tp: TPGroup | None) -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.world_size)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W `[output_size, input_size]` as held on this rank (a shard of the
    checkpoint's weight under tensor parallelism), as in nn.Linear and HF checkpoints."""

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
        self.packed: cpu_gemm.Packed | None = None  # the packed copy of the weight (cpu_gemm), once prepacked
        # A quantized weight, in place of `weight` (None then): layers/quantization/linear_method.py
        self.quant: QuantizedLinear | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None
    ) -> None:
        default_weight_loader(param, loaded, shard_id)

    def prepack_for_cpu(self) -> bool:
        """After loading: run this layer on a packed copy of its weight when that is faster on this
        CPU (cpu_gemm); the dense weight is released (it becomes an empty tensor)."""
        if self.quant is not None:
            return self.quant.prepack_for_cpu()
        return cpu_gemm.prepack_layer(self)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.matmul(x, bias)
        return cpu_gemm.matmul(x, self.weight, self.packed, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def stack_linear(self, dtype: torch.dtype) -> tuple[_cpu.DecoderLinear, torch.Tensor | None] | None:
        """This layer's weight for the C++ decoder stack (models/cpu_stack.py) with the fp32 bias it
        points at, where the layer multiplies on our CPU kernels on one rank; None otherwise."""
        if getattr(self, "tp", None) is not None or getattr(self, "tp_size", 1) != 1:
            return None
        if self.quant is not None:
            return self.quant.stack_linear(self.bias, dtype)
        return cpu_gemm.stack_linear(self.packed, self.bias, dtype)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks: this rank holds output rows
    [rank * out / tp, (rank + 1) * out / tp) and computes only those (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup | None = None) -> None:
        self.tp_rank, self.tp_size = tp_rank_size(tp)
        self.full_output_size = output_size
        super().__init__(input_size, divide(output_size, self.tp_size, "output size"), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter is not packed, got shard id {shard_id!r}")
        _load_rows(param, loaded, 0, self.full_output_size, self.tp_rank * self.output_size, self.output_size)


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks: this rank holds input columns
    [rank * in / tp, (rank + 1) * in / tp), multiplies its slice of x and the partial results are
    summed over ranks (one all-reduce); the bias, held whole, is added once after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup | None = None) -> None:
        self.tp = tp
        self.tp_rank, self.tp_size = tp_rank_size(tp)
        self.full_input_size = input_size
        super().__init__(divide(input_size, self.tp_size, "input size"), output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter is not packed, got shard id {shard_id!r}")
        if param is self.bias:
            default_weight_loader(param, loaded)
            return
        check_shape((self.output_size, self.full_input_size), loaded_shape(loaded))
        with torch.no_grad():
            param.copy_(read_part(loaded, 1, self.tp_rank * self.input_size, self.input_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul; each rank holds
    its slice of each (rows [gate shard | up shard]).

    Shard ids are indices into `output_sizes` (gate_proj -> 0, up_proj -> 1).
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 tp: TPGroup | None = None) -> None:
        self.full_output_sizes = list(output_sizes)
        size = tp_rank_size(tp)[1]
        self.output_sizes = [divide(s, size, "output size") for s in self.full_output_sizes]
        super().__init__(input_size, sum(self.full_output_sizes), bias, tp)

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard id must be an index < {len(self.output_sizes)}, got {shard_id!r}"
            )
        size = self.output_sizes[shard_id]
        _load_rows(param, loaded, sum(self.output_sizes[:shard_id]), self.full_output_sizes[shard_id],
                   self.tp_rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused: output rows are [q heads | k heads | v heads] of this rank.

    Each rank keeps num_heads / tp query heads and the KV heads they attend with: num_kv_heads / tp
    of them, or, when there are fewer KV heads than ranks, the one KV head its query heads share
    (replicated on tp / num_kv_heads ranks, as vLLM does).
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
        tp: TPGroup | None = None,
    ) -> None:
        rank, size = tp_rank_size(tp)
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, size, "the number of attention heads")
        if num_kv_heads >= size:
            self.num_kv_heads = divide(num_kv_heads, size, "the number of KV heads")
            self.kv_head_start = rank * self.num_kv_heads
        else:
            divide(size, num_kv_heads, "the tensor-parallel size, over the number of KV heads,")
            self.num_kv_heads = 1
            self.kv_head_start = rank * num_kv_heads // size
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias)
        self.tp_rank, self.tp_size = rank, size
        self.full_output_size = (num_heads + 2 * num_kv_heads) * head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None
    ) -> None:
        d = self.head_dim
        kv_start = self.kv_head_start * d
        # shard id -> (offset in our fused weight, rows in the checkpoint, first row we keep, rows)
        shards = {
            "q": (0, self.total_num_heads * d, self.tp_rank * self.q_size, self.q_size),
            "k": (self.q_size, self.total_num_kv_heads * d, kv_start, self.kv_size),
            "v": (self.q_size + self.kv_size, self.total_num_kv_heads * d, kv_start, self.kv_size),
        }
        if shard_id not in shards:
            raise ValueError(f"shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        _load_rows(param, loaded, *shards[shard_id])  # type: ignore[index]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


def _load_rows(param: nn.Parameter, loaded: Loaded, offset: int, full_rows: int, start: int, size: int) -> None:
    """Rows start:start+size of a checkpoint tensor of `full_rows` rows into rows offset:offset+size
    of a packed weight (dim 0) or bias."""
    check_shape((full_rows, *param.shape[1:]), loaded_shape(loaded))
    with torch.no_grad():
        param.narrow(0, offset, size).copy_(read_part(loaded, 0, start, size))
