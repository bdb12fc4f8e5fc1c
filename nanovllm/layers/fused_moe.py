"""A mixture-of-experts MLP: every expert a SiLU-gated MLP, each row summing the outputs of the
top_k experts its router logits choose, weighted by their softmax (docs/design.md, "Mixture of
experts").

The experts' weights are two parameters, w13 `[E, 2I, H]` (gate rows, then up rows) and w2
`[E, H, I]`, filled expert by expert from the checkpoint's own tensor names (`checkpoint_shards`,
read by models/loader.py). Under tensor parallelism each rank holds every expert's slice of the
intermediate dimension (I / tp rows of gate and up, I / tp columns of down) and the partial
outputs are summed with one all-reduce, as for a dense MLP.

Where the forward runs: on CPU the C++ layer (nanovllm/cpu/moe.py) on the experts packed after loading for
the dense layers' GEMM kernel; on CUDA the Triton grouped GEMM (triton_moe.py); elsewhere, and on
a GPU without Triton, torch ops (moe_torch.py).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nanovllm.cpu import moe as cpu_moe
from nanovllm.layers import moe_torch
from nanovllm.layers.linear import (
    Loaded,
    ShardId,
    check_shape,
    divide,
    loaded_shape,
    read_part,
    set_weight_loader,
    tp_rank_size,
)

if TYPE_CHECKING:
    from nanovllm import _cpu
    from nanovllm.distributed.parallel_state import TPGroup
    from nanovllm.layers.quantization.linear_method import QuantizedExperts

logger = logging.getLogger(__name__)

# The checkpoint's module names of an expert's (gate, up, down) projections.
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


class FusedMoE(nn.Module):
    """`forward(x [T, H], router_logits [T, E]) -> [T, H]` (summed over ranks under tensor
    parallelism)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, expert_names: tuple[str, str, str] = QWEN_EXPERT_NAMES,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"a mixture of experts needs at least one expert, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k (experts per token) must be between 1 and the number of experts "
                             f"({num_experts}), got {top_k}")
        self.tp = tp
        self.tp_rank, self.tp_size = tp_rank_size(tp)
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = divide(intermediate_size, self.tp_size, "the experts' intermediate size")
        self.renormalize = renormalize
        inter = self.intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter), requires_grad=False)
        self.expert_names = expert_names
        gate, up, down = expert_names
        set_weight_loader(self.w13_weight, self._load_w13)
        set_weight_loader(self.w2_weight, self._load_w2)
        self.w13_weight.checkpoint_shards = [  # type: ignore[attr-defined]
            (f"{e}.{name}.weight", (e, half)) for e in range(num_experts) for half, name in enumerate((gate, up))
        ]
        self.w2_weight.checkpoint_shards = [(f"{e}.{down}.weight", e) for e in range(num_experts)]  # type: ignore[attr-defined]
        self.packed: cpu_moe.PackedExperts | None = None
        # int8 / int4 experts (layers/quantization/linear_method.py), in place of w13 / w2
        self.quant: QuantizedExperts | None = None

    def _load_w13(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        if not isinstance(shard_id, tuple):
            raise ValueError(f"expected an (expert, gate or up) shard id, got {shard_id!r}")
        expert, half = shard_id
        check_shape((self.full_intermediate_size, self.hidden_size), loaded_shape(loaded))
        inter = self.intermediate_size
        with torch.no_grad():
            param[expert, half * inter:(half + 1) * inter].copy_(read_part(loaded, 0, self.tp_rank * inter, inter))

    def _load_w2(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"expected an expert index as shard id, got {shard_id!r}")
        check_shape((self.hidden_size, self.full_intermediate_size), loaded_shape(loaded))
        inter = self.intermediate_size
        with torch.no_grad():
            param[shard_id].copy_(read_part(loaded, 1, self.tp_rank * inter, inter))

    def prepack_for_cpu(self) -> bool:
        """After loading: pack the experts for this CPU's GEMM kernel (cpu_moe.pack_experts); the
        dense weights are released. Quantized experts are packed for the quantized GEMM instead."""
        if self.quant is not None:
            return self.quant.prepack_for_cpu()
        if self.packed is not None:
            return False
        self.packed = cpu_moe.pack_experts(self.w13_weight, self.w2_weight)
        if self.packed is None:
            return False
        self.w13_weight.data = self.w13_weight.data.new_empty(0)
        self.w2_weight.data = self.w2_weight.data.new_empty(0)
        return True

    def stack_experts(self, router: _cpu.DecoderLinear, dtype: torch.dtype) -> _cpu.DecoderMoe | None:
        """This layer, after its router, for the C++ decoder stack (models/cpu_stack.py), where it
        runs as one C++ call on one rank; None otherwise."""
        if self.tp is not None:
            return None
        if self.quant is not None:
            return self.quant.stack_experts(router, self.top_k, self.renormalize, dtype)
        return cpu_moe.stack_experts(router, self.packed, self.top_k, self.renormalize, dtype)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = self._experts(x, router_logits)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _experts(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            quant = self.quant
            fused = quant.cpu_experts(x, logits, self.top_k, self.renormalize)
            if fused is not None:
                return fused
            gate_up = lambda rows, e: quant.w13[e].matmul(rows, None)  # noqa: E731
            down = lambda rows, e: quant.w2[e].matmul(rows, None)  # noqa: E731
            if cpu_moe.can_run(x, logits):
                return cpu_moe.looped_experts(x, logits, gate_up, down, self.top_k, self.renormalize)
            ids, weights = moe_torch.route(logits, self.top_k, self.renormalize)
            return moe_torch.looped_experts(x, ids, weights, gate_up, down)
        if cpu_moe.can_run(x, logits):
            return cpu_moe.fused_experts(x, logits, self.w13_weight, self.w2_weight, self.packed, self.top_k,
                                         self.renormalize)
        ids, weights = moe_torch.route(logits, self.top_k, self.renormalize)
        triton_experts = _triton() if x.is_cuda else None
        experts = moe_torch.experts if triton_experts is None else triton_experts
        return experts(x, ids, weights, self.w13_weight, self.w2_weight)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, renormalize={self.renormalize}")


@functools.cache
def _triton() -> Any:
    """triton_moe.fused_experts, or None where triton is missing (then torch ops run, slowly)."""
    try:
        from nanovllm.layers.triton_moe import fused_experts
    except Exception as e:  # no triton, or one that cannot compile for this GPU
        logger.warning("Triton is unavailable (%s): the MoE layers fall back to torch ops", e)
        return None
    return fused_experts
