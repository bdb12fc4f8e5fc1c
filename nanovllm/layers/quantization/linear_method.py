"""Quantized weights in the model's linear layers.

Before loading, `prepare_model` gives every linear layer the config quantizes, in place of its
dense `weight`, one placeholder parameter per checkpoint tensor of its format (named like the
tensor: `weight_packed`, `qweight`, ...), whose weight loader keeps the tensor as read, per fused
shard (q/k/v, gate/up). After loading, `finish_model` turns each layer's tensors into one
QuantizedWeight (the format's unpacking checks every shape), drops the placeholders, and on CPU
packs it for csrc/cpu_gemm_quant.cpp. A load-time scheme ("int8"/"int4") has one placeholder, the
dense `weight`, whose loader rounds each shard to nearest as it is read, in the checkpoint's own
dtype: the weights `nanovllm quantize` writes, whatever dtype the model runs in, and no dense copy
of the layer is ever held. The embedding and the LM head stay in the model's dtype.

Forward: the CPU kernel on its packed copy; on CUDA the Triton dequantizing GEMM; elsewhere (or
before packing) `F.linear` on the dequantized weight, the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.linear import (
    LinearBase,
    Loaded,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ShardId,
    read_all,
    set_weight_loader,
)
from nanovllm.layers.quantization import cpu_kernel, cpu_moe
from nanovllm.layers.quantization.config import QuantConfig, WeightScheme
from nanovllm.layers.quantization.weights import QuantizedWeight, concat_rows, quantize_rtn

if TYPE_CHECKING:
    from nanovllm import _cpu

logger = logging.getLogger(__name__)


class QuantizedLinear:
    """A linear layer's quantized weight (`layer.quant`): the checkpoint tensors while loading, then
    the QuantizedWeight and its packed form for this device's kernel."""

    def __init__(self, shards: list[tuple[ShardId, int, str]], in_features: int, config: QuantConfig,
                 scheme: WeightScheme) -> None:
        self.shards = shards  # (shard id, its rows, the checkpoint module's name), in the fused order
        self.in_features = in_features
        self.config = config
        self.scheme = scheme
        self.loaded: dict[ShardId, dict[str, torch.Tensor]] = {sid: {} for sid, _, _ in shards}
        self.rounded: dict[ShardId, QuantizedWeight] = {}  # a load-time scheme's shards, as read
        self.weight: QuantizedWeight | None = None
        self.cpu: cpu_kernel.PackedQuantWeight | None = None
        self.triton: object | None = None  # triton_gemm.TritonWeight on CUDA

    def tensor_loader(self, name: str):  # noqa: ANN201 - a WeightLoader
        def load(param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
            if shard_id not in self.loaded:
                raise ValueError(f"shard id {shard_id!r} is not one of {list(self.loaded)}")
            if self.config.method == "rtn":
                self.rounded[shard_id] = self._round(read_all(loaded), shard_id)
            else:
                self.loaded[shard_id][name] = read_all(loaded)
        return load

    def _round(self, weight: torch.Tensor, shard_id: ShardId) -> QuantizedWeight:
        """A load-time scheme's dense shard rounded to nearest, its scales in the tensor's own dtype
        (what `nanovllm quantize` does to the same checkpoint tensor)."""
        rows = next(rows for sid, rows, _ in self.shards if sid == shard_id)
        if tuple(weight.shape) != (rows, self.in_features):
            raise ValueError(f"shape {tuple(weight.shape)} does not match the layer's {[rows, self.in_features]}")
        s = self.scheme
        return quantize_rtn(weight, s.bits, s.group_size, s.symmetric, scale_dtype=weight.dtype)

    def finish(self, device: torch.device) -> None:
        if self.config.method == "rtn":
            parts = [self.rounded[sid] for sid, _, _ in self.shards]
        else:
            parts = [self.config.unpack(self.loaded[sid], self.scheme, rows, self.in_features, module)
                     for sid, rows, module in self.shards]
        self.loaded, self.rounded = {}, {}
        self.set_weight(concat_rows(parts), device)

    def set_weight(self, weight: QuantizedWeight, device: torch.device) -> None:
        self.weight = weight
        if device.type == "cuda":
            from nanovllm.layers.quantization import triton_gemm

            self.triton = triton_gemm.TritonWeight.from_weight(weight, device)
            self.weight = None

    def prepack_for_cpu(self) -> bool:
        """Pack for the CPU kernel (once) and release the unpacked copy."""
        if self.cpu is not None or self.weight is None:
            return False
        self.cpu = cpu_kernel.pack(self.weight)
        self.weight = None
        return True

    def stack_linear(self, bias: torch.Tensor | None,
                     dtype: torch.dtype) -> tuple[_cpu.DecoderLinear, torch.Tensor | None] | None:
        """The packed CPU weight for the C++ decoder stack (cpu_kernel.stack_linear); None without one."""
        return None if self.cpu is None else cpu_kernel.stack_linear(self.cpu, bias, dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.cpu is not None:
            return cpu_kernel.linear(x, self.cpu, bias)
        if self.triton is not None:
            from nanovllm.layers.quantization import triton_gemm

            return triton_gemm.linear(x, self.triton, bias)  # type: ignore[arg-type]
        if self.weight is None:
            raise RuntimeError("quantized layer used before its weights were loaded")
        return F.linear(x, self.weight.dequantize(x.dtype).to(x.device), bias)

    def stored_bytes(self) -> int:
        """Bytes a forward reads for the weight (packed values, scales, zero points)."""
        if self.cpu is not None:
            return self.cpu.nbytes()
        if self.weight is not None:
            return self.weight.stored_bytes(scale_bytes=4)
        return self.triton.nbytes()  # type: ignore[union-attr]


class QuantizedExperts:
    """A mixture-of-experts layer's quantized experts (`FusedMoE.quant`): per expert, its gate and up
    projections as one QuantizedLinear (gate rows first, as w13) and its down projection as another."""

    def __init__(self, layer: FusedMoE, name: str, config: QuantConfig, scheme: WeightScheme) -> None:
        gate, up, down = layer.expert_names
        inter, hidden = layer.intermediate_size, layer.hidden_size
        self.scheme = scheme
        self.w13 = [QuantizedLinear([(0, inter, f"{name}.{e}.{gate}"), (1, inter, f"{name}.{e}.{up}")], hidden,
                                    config, scheme) for e in range(layer.num_experts)]
        self.w2 = [QuantizedLinear([(None, hidden, f"{name}.{e}.{down}")], inter, config, scheme)
                   for e in range(layer.num_experts)]
        self.fused: cpu_moe.PackedQuantExperts | None = None  # every expert, for the one-call CPU layer

    def placeholders(self, layer: FusedMoE, tensor: str) -> tuple[nn.Parameter, nn.Parameter]:
        """The two parameters the loader fills with every expert's checkpoint tensor `tensor`
        (`E.gate_proj.weight_packed`, ...), each read into its expert's QuantizedLinear."""
        gate, up, down = layer.expert_names
        w13, w2 = _empty_parameter(), _empty_parameter()
        w13.checkpoint_shards = [(f"{e}.{name}.{tensor}", (e, half))  # type: ignore[attr-defined]
                                 for e in range(len(self.w13)) for half, name in enumerate((gate, up))]
        w2.checkpoint_shards = [(f"{e}.{down}.{tensor}", e) for e in range(len(self.w2))]  # type: ignore[attr-defined]
        set_weight_loader(w13, lambda p, loaded, sid=None: self.w13[sid[0]].tensor_loader(tensor)(p, loaded, sid[1]))
        set_weight_loader(w2, lambda p, loaded, sid=None: self.w2[sid].tensor_loader(tensor)(p, loaded, None))
        return w13, w2

    def finish(self, device: torch.device) -> None:
        for quant in (*self.w13, *self.w2):
            quant.finish(device)

    def prepack_for_cpu(self) -> bool:
        """Every expert packed for the one-call layer (cpu_moe.fused_experts) when their formats
        allow it, else each projection for its own GEMM; the unpacked copies are released."""
        weights13 = [quant.weight for quant in self.w13]
        weights2 = [quant.weight for quant in self.w2]
        if self.fused is not None or any(w is None for w in (*weights13, *weights2)):
            return False
        if cpu_moe.can_pack(weights13, weights2):  # type: ignore[arg-type]
            self.fused = cpu_moe.pack_experts(weights13, weights2)  # type: ignore[arg-type]
            for quant in (*self.w13, *self.w2):
                quant.weight = None
            return True
        return any([quant.prepack_for_cpu() for quant in (*self.w13, *self.w2)])

    def stack_experts(self, router: _cpu.DecoderLinear, top_k: int, renormalize: bool,
                      dtype: torch.dtype) -> _cpu.DecoderMoe | None:
        """The fused experts for the C++ decoder stack (cpu_moe.stack_experts); None when not fused."""
        return None if self.fused is None else cpu_moe.stack_experts(router, self.fused, top_k, renormalize, dtype)

    def cpu_experts(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor | None:
        """The layer's output from the fused experts, None when they were not packed so (run the loop)."""
        if self.fused is None or x.device.type != "cpu":
            return None
        return cpu_moe.fused_experts(x, logits, self.fused, top_k, renormalize)

    def stored_bytes(self) -> int:
        if self.fused is not None:
            return self.fused.nbytes()
        return sum(quant.stored_bytes() for quant in (*self.w13, *self.w2))


def _empty_parameter() -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=torch.int32, device="cpu"), requires_grad=False)


def checkpoint_module(model: nn.Module, name: str) -> str:
    """Our module name `name` as the checkpoint spells it (Mixtral's `mlp` is `block_sparse_moe`):
    the names the quantization config's targets and ignore list are written against."""
    renamed: dict[str, str] = getattr(model, "checkpoint_module_names", {})
    return ".".join(renamed.get(part, part) for part in name.split("."))


def _checkpoint_shards(model: nn.Module, name: str, layer: LinearBase) -> list[tuple[ShardId, int, str]]:
    """(shard id, rows, checkpoint module name) of each checkpoint module fused into `layer`."""
    name = checkpoint_module(model, name)
    prefix, _, ours = name.rpartition(".")
    # The model's checkpoint module -> (fused module, shard id) map (models/decoder.py), read by
    # name: layers sit below models and do not import them.
    mapping: dict[str, tuple[str, ShardId]] = getattr(model, "packed_modules_mapping", {})
    ckpt = {(our, sid): theirs for theirs, (our, sid) in mapping.items()}
    if isinstance(layer, QKVParallelLinear):
        d = layer.head_dim
        sizes: list[tuple[ShardId, int]] = [("q", layer.total_num_heads * d), ("k", layer.total_num_kv_heads * d),
                                            ("v", layer.total_num_kv_heads * d)]
    elif isinstance(layer, MergedColumnParallelLinear):
        sizes = list(enumerate(layer.full_output_sizes))
    else:
        return [(None, layer.output_size, name)]
    return [(sid, rows, f"{prefix}.{ckpt[(ours, sid)]}") for sid, rows in sizes]


def _linear_layers(model: nn.Module) -> list[tuple[str, LinearBase]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LinearBase)]


def _stored_dense(config: QuantConfig, scheme: WeightScheme, shards: list[tuple[ShardId, int, str]],
                  stored: Set[str]) -> bool:
    """Whether the checkpoint holds this (checkpoint-format) layer's every shard as a dense weight
    and none of its quantized tensors; a layer stored half one way, half the other, is an error."""
    if config.method == "rtn" or not stored:
        return False
    first = config.tensor_names(scheme)[0]
    dense = [f"{module}.weight" in stored and f"{module}.{first}" not in stored for _, _, module in shards]
    if any(dense) and not all(dense):
        raise ValueError(f"the fused modules {[m for _, _, m in shards]} are stored partly quantized, partly dense; "
                         "they must be stored one way")
    return all(dense)


def _scheme(config: QuantConfig, shards: list[tuple[ShardId, int, str]]) -> WeightScheme | None:
    schemes = {config.scheme_for(module) for _, _, module in shards}
    if len(schemes) > 1:
        raise ValueError(f"the fused modules {[m for _, _, m in shards]} are quantized differently ({schemes}); "
                         "they must share one scheme (or all be left unquantized)")
    return schemes.pop()


def _drop_dense_weight(layer: LinearBase) -> None:
    layer.weight = None  # type: ignore[assignment]  (nn.Module keeps the name registered, as None)


def prepare_model(model: nn.Module, config: QuantConfig, stored: Set[str] = frozenset()) -> int:
    """Before loading: each quantized linear layer, and each mixture-of-experts layer whose experts
    are quantized, gets placeholders for its checkpoint tensors (QuantConfig.tensor_names: the
    format's, or a load-time scheme's dense `weight`) in place of its dense weights. A layer the
    checkpoint (its tensor names: `stored`) holds as a dense weight stays dense whatever the config
    says, as vLLM reads GPTQ checkpoints that do not list their unquantized layers. Returns how
    many layers are quantized."""
    count = 0
    for name, layer in _linear_layers(model):
        shards = _checkpoint_shards(model, name, layer)
        scheme = _scheme(config, shards)
        if scheme is None or _stored_dense(config, scheme, shards, stored):
            continue
        _refuse_tensor_parallel(layer)
        quant = QuantizedLinear(shards, layer.input_size, config, scheme)
        _drop_dense_weight(layer)
        for tensor in config.tensor_names(scheme):
            param = _empty_parameter()
            param.optional_in_checkpoint = tensor in config.optional_tensors(scheme)  # type: ignore[attr-defined]
            set_weight_loader(param, quant.tensor_loader(tensor))
            layer.register_parameter(tensor, param)
        layer.quant = quant
        count += 1
    for name, moe, scheme in _quantized_experts(model, config):
        experts = QuantizedExperts(moe, checkpoint_module(model, name), config, scheme)
        _drop_dense_experts(moe)
        for tensor in config.tensor_names(scheme):
            w13, w2 = experts.placeholders(moe, tensor)
            w13.optional_in_checkpoint = w2.optional_in_checkpoint = (  # type: ignore[attr-defined]
                tensor in config.optional_tensors(scheme))
            moe.register_parameter(f"w13_{tensor}", w13)
            moe.register_parameter(f"w2_{tensor}", w2)
        moe.quant = experts
        count += 1
    return count


def finish_model(model: nn.Module, config: QuantConfig, device: torch.device) -> int:
    """After loading: every quantized layer's shards made into one QuantizedWeight (unpacked, or
    as a load-time scheme rounded them) and its placeholders dropped. Returns how many layers are
    quantized."""
    count = 0
    for _, layer in _linear_layers(model):
        quant = layer.quant
        if quant is None:
            continue
        for tensor in config.tensor_names(quant.scheme):
            delattr(layer, tensor)
        _drop_dense_weight(layer)  # a load-time scheme's placeholder was the dense weight itself
        quant.finish(device)
        count += 1
    for _, moe, scheme in _quantized_experts(model, config):
        for tensor in config.tensor_names(scheme):
            delattr(moe, f"w13_{tensor}")
            delattr(moe, f"w2_{tensor}")
        _drop_dense_experts(moe)
        moe.quant.finish(device)  # type: ignore[union-attr]
        count += 1
    return count


def _quantized_experts(model: nn.Module, config: QuantConfig) -> list[tuple[str, FusedMoE, WeightScheme]]:
    """The mixture-of-experts layers whose experts `config` quantizes, with their one scheme."""
    out = []
    for name, moe in model.named_modules():
        if not isinstance(moe, FusedMoE):
            continue
        prefix = checkpoint_module(model, name)
        modules = [f"{prefix}.{e}.{proj}" for e in range(moe.num_experts) for proj in moe.expert_names]
        schemes = {config.scheme_for(module) for module in modules}
        if len(schemes) > 1:
            raise ValueError(f"the experts of {prefix} are quantized differently ({schemes}); every expert's "
                             "projections must share one scheme (or all be left unquantized)")
        scheme = schemes.pop()
        if scheme is not None:
            _refuse_tensor_parallel(moe)
            out.append((name, moe, scheme))
    return out


def _drop_dense_experts(moe: FusedMoE) -> None:
    moe.w13_weight = None  # type: ignore[assignment]  (registered names kept, as None)
    moe.w2_weight = None  # type: ignore[assignment]


def _refuse_tensor_parallel(layer: LinearBase | FusedMoE) -> None:
    if getattr(layer, "tp_size", 1) > 1:
        raise ValueError("quantized weights under tensor parallelism are not supported yet: run with "
                         "tensor_parallel_size=1")
