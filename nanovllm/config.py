"""Engine options (the `LLM(...)` keyword arguments) and how their defaults resolve."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.distributed.parallel_state import ParallelConfig

# Without a GPU to measure, the CPU KV cache gets this much unless told otherwise.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Tokens per step by default. A GPU wants large steps; a CPU's GEMMs run fastest on a few hundred
# rows (the activations stay in cache): a batch prefill of 64 prompts of the built-in model took
# 1.07-1.2 s at 512 against 1.2-1.7 s at 2048-8192 (benchmarks/RESULTS.md).
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 512}


@dataclass
class EngineConfig:
    model: str
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_kvcache_blocks: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    # None: as the checkpoint is stored; "int8" / "int4": quantize its linear layers while loading
    # (layers/quantization); "compressed-tensors" / "awq" / "gptq": must be the checkpoint's format.
    quantization: str | None = None
    device: str = "auto"
    # Tensor parallelism (docs/design.md, "Tensor parallelism"); see ParallelConfig.
    tensor_parallel_size: int = 1
    distributed_backend: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "kv_cache_memory_bytes", "num_kvcache_blocks"):
            positive(name)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.parallel  # validates the parallel options

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.nnodes, self.node_rank, self.master_addr,
                              self.master_port, self.distributed_backend)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available")
        return device

    def resolve_lengths(self, max_position_embeddings: int) -> tuple[int, int]:
        """(max_model_len, max_num_batched_tokens) with defaults filled in."""
        max_model_len = self.max_model_len or max_position_embeddings
        if max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_position_embeddings}"
            )
        # Chunked prefill splits long prompts, so the budget need not cover max_model_len.
        default = DEFAULT_BATCHED_TOKENS.get(self.resolve_device().type, DEFAULT_BATCHED_TOKENS["cuda"])
        budget = self.max_num_batched_tokens or max(default, self.max_num_seqs)
        return max_model_len, budget
