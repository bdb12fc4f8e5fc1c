"""The engine's options, declared once, and the configuration they resolve to.

`EngineConfig` holds the options as a user gives them: `LLM(model, **options)`, and the engine flags
of the command line, which entrypoints/cli.py derives from these fields (name, type, default, and
the help text in each field's metadata). `EngineConfig.resolve()` reads the model's config.json and
turns the options into a `ResolvedConfig`: the device, the dtype, the lengths and the parsed model
config, fixed for the engine's life. Each process resolves once (rank 0 for the engine, each
tensor-parallel worker for itself); everything below the engine takes the resolved object.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from nanovllm.builtin_code import resolve_builtin
from nanovllm.distributed.parallel_state import ParallelConfig
from nanovllm.model_config import ModelConfig, load_model_config, resolve_dtype
from nanovllm.sampling_params import SEED_MAX, SEED_MIN

# Without a GPU to measure, the CPU KV cache gets this much unless told otherwise.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def cpu_kv_cache_bytes() -> int:
    """The CPU KV cache's default size: vLLM's CPU setting VLLM_CPU_KVCACHE_SPACE (GiB; unset or 0:
    nanovllm's default), which its users carry over, else DEFAULT_CPU_KV_CACHE_BYTES."""
    value = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not value:
        return DEFAULT_CPU_KV_CACHE_BYTES
    try:
        gib = int(value)
    except ValueError:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got {value!r}") from None
    if gib < 0:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be >= 0 GiB, got {gib}")
    return gib << 30 if gib else DEFAULT_CPU_KV_CACHE_BYTES
# Tokens per step by default. A GPU wants large steps; a CPU's GEMMs run fastest on a few hundred
# rows (the activations stay in cache): a batch prefill of 64 prompts of the built-in model took
# 1.07-1.2 s at 512 against 1.2-1.7 s at 2048-8192 (benchmarks/RESULTS.md).
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 512}
# A mixture-of-experts model's step reads every expert some token chose, from memory: at 512 tokens
# nearly all of them, each step. Fewer, larger steps read them less often: the Qwen3-MoE-shaped
# model's batch prefill of 32 prompts ran 1.1x faster at 2048 (vLLM's CPU server default) than at 512,
# and no faster at 4096 (Intel Xeon with AMX, bf16).
DEFAULT_CPU_MOE_BATCHED_TOKENS = 2048

# Tokens per KV-cache block, also where block_size is None (vLLM's "the platform's default").
DEFAULT_BLOCK_SIZE = 16
# The C++ core's bounds on the KV cache (csrc/bindings.cpp): block ids and slots are int32.
MAX_BLOCK_SIZE = 1 << 16
MAX_CACHE_SLOTS = 2**31 - 1

SPEC_METHODS = ("ngram", "draft_model")
# With `adaptive` speculation and no disable_by_batch_size: no drafts while this many sequences run
# or wait. A draft costs a step what a token does once its GEMMs are compute-bound, which on a CPU
# is a handful of tokens (bytes / bandwidth = flops / peak at ~6 tokens for bf16 weights, ~12 for
# fp32, on the 2-core dev machine): measured there (benchmarks/RESULTS.md, "Speculative decoding"),
# n-gram speculation already lost 9-20% at batch 8, on vLLM's CPU engine too. A GPU stays
# memory-bound far longer.
SPEC_AUTO_DISABLE_BATCH = {"cpu": 8, "cuda": 128}


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config` as vLLM names it (docs/design.md, "Speculative decoding"): "ngram" drafts
    from each sequence's own tokens (the longest suffix of prompt_lookup_min..max tokens seen before,
    and what followed it), "draft_model" from a smaller model with the same vocabulary (`model`).
    `disable_by_batch_size`: no drafts while at least that many sequences run or wait (vLLM's rule);
    `adaptive` (ours): each sequence drafts fewer tokens, down to none for a while, when few of its
    drafts are accepted."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    @classmethod
    def parse(cls, value: dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict or its JSON (the command line's --speculative-config); ValueError naming the field."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} is not a field this engine takes "
                             f"(it takes {', '.join(sorted(known))})")
        v = dict(value)
        method = v.get("method") or ("draft_model" if v.get("model") else None)
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, got {method!r}")
        v["method"] = method

        def integer(name: str, lo: int, required: bool = False) -> int | None:
            x = v.get(name)
            if x is None:
                if required:
                    raise ValueError(f"speculative_config.{name} is required")
                return None
            if not isinstance(x, int) or isinstance(x, bool) or x < lo:
                raise ValueError(f"speculative_config.{name} must be an integer >= {lo}, got {x!r}")
            return x

        integer("num_speculative_tokens", 1, required=True)
        # The CPU attention keeps a verification's rows (this many + 1) on its decode arithmetic up to
        # 65 (csrc/cpu_attention.cpp kDecodeExactRows): raising this bound means raising that one.
        if v["num_speculative_tokens"] > 64:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most 64, got "
                             f"{v['num_speculative_tokens']}")
        integer("disable_by_batch_size", 1)
        if not isinstance(v.get("adaptive", True), bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {v['adaptive']!r}")
        if method == "ngram":
            if v.get("model") is not None:
                raise ValueError("speculative_config.model is for method 'draft_model'; 'ngram' drafts from the "
                                 "sequence's own tokens")
            # vLLM's defaults: either bound alone sets both; neither gives 5.
            lo, hi = integer("prompt_lookup_min", 1), integer("prompt_lookup_max", 1)
            lo, hi = lo or hi or 5, hi or lo or 5
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) is larger than prompt_lookup_max ({hi})")
            v["prompt_lookup_min"], v["prompt_lookup_max"] = lo, hi
        else:
            if not isinstance(v.get("model"), str) or not v["model"]:
                raise ValueError("speculative_config.model (the draft model's directory) is required for method "
                                 "'draft_model'")
            v["model"] = resolve_builtin(v["model"])  # "builtin-code-draft": the shipped draft
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if v.get(name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram'")
        return cls(**v)


# Options whose None means the default, as vLLM's EngineArgs read them.
_NONE_IS_DEFAULT = frozenset({"max_num_seqs", "enable_prefix_caching", "enable_chunked_prefill"})


def option(default: Any, help: str, *, aliases: tuple[str, ...] = (), choices: tuple[Any, ...] | None = None,
           metavar: str | None = None, serve_only: bool = False) -> Any:
    """An engine option: its default and help text; `aliases` are extra command-line flags (vLLM's
    spellings); `serve_only` options (several machines) are flags of `serve` alone."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices, "metavar": metavar,
                                            "serve_only": serve_only})


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(metadata={"help": "a Hugging Face model directory (config.json, *.safetensors, tokenizer), "
                                         "or builtin-code / builtin-code-draft: the small code model shipped with "
                                         "nanovllm and its draft"})
    tokenizer: str | None = option(None, "a tokenizer directory (or builtin-code), when not the model's (default: the "
                                   "model directory)")
    trust_remote_code: bool = option(
        False, "accepted for vLLM's command lines; changes nothing, since nanovllm never runs code from a model "
        "directory: its own classes run the supported architectures, and tokenizers load without remote code")
    dtype: str | torch.dtype = option(
        "auto", "weights, activations and KV cache: auto (the checkpoint's; a bf16 checkpoint runs float32 on a "
        "CPU without AVX512-BF16/AMX), float32, bfloat16, float16 (GPU only)")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's "
                                       "max_position_embeddings)")
    disable_sliding_window: bool = option(
        False, "for a model with a sliding window, max_model_len defaults to the window (within it the window "
        "changes nothing; sliding-window attention itself is not implemented), as vLLM's")
    max_num_seqs: int = option(256, "sequences running at once (a step's largest batch)")
    max_num_batched_tokens: int | None = option(
        None, "tokens per step, prompts chunked to fit (default: 8192 on GPU, 512 on CPU, 2048 for a mixture-of-experts "
        "model on CPU; at least max_num_seqs)")
    block_size: int | None = option(DEFAULT_BLOCK_SIZE, f"tokens per KV-cache block (None: {DEFAULT_BLOCK_SIZE})")
    kv_cache_dtype: str = option("auto", "the KV cache's dtype: auto, the model's (--dtype); fp8 KV caches are not "
                                 "supported")
    enable_chunked_prefill: bool = option(
        True, "split prompts over steps to fit --max-num-batched-tokens; always on (the scheduler has no unchunked "
        "mode, so turning it off is refused)")
    max_logprobs: int = option(20, "the most logprobs / prompt_logprobs a request may ask for (-1: the vocabulary "
                               "size)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of cached prompt prefixes",
                                         aliases=("--no-prefix-caching",))
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory the engine may use (the KV cache "
                                           "gets what the weights and a profiled step leave)",
                                           aliases=("--device-memory-utilization",))
    kv_cache_memory_bytes: int | None = option(None, "KV cache size in bytes (default on CPU: "
                                               "$VLLM_CPU_KVCACHE_SPACE GiB as vLLM's CPU engine, else 1 GiB; "
                                               "on GPU: from gpu_memory_utilization)")
    num_kvcache_blocks: int | None = option(None, "KV cache size in blocks (overrides the two above)",
                                            aliases=("--num-gpu-blocks-override",))
    enforce_eager: bool = option(False, "no CUDA graphs: run every decode step eagerly")
    seed: int | None = option(0, "seed of the sampling generator for requests without their own seed (None: "
                                 "a random one)")
    generation_config: str = option(
        "auto", "the default sampling parameters of a request that leaves them out: auto (those the model's "
        "generation_config.json sets: temperature, top_p, top_k, min_p, the penalties, max_new_tokens as "
        "max_tokens), vllm (vLLM's neutral ones), or a directory holding a generation_config.json")
    override_generation_config: dict[str, Any] | str | None = option(
        None, "default sampling parameters over the generation config's, as JSON: {\"temperature\": 0.5}",
        metavar="JSON")
    speculative_config: dict[str, Any] | str | None = option(
        None, "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} or {\"method\": \"draft_model\", \"model\": DIR, "
        "\"num_speculative_tokens\": 4}; optional disable_by_batch_size, adaptive (default true)",
        aliases=("-sc",), metavar="JSON")
    quantization: str | None = option(
        None, "int8 or int4: quantize the linear layers while loading (weight-only, round to nearest: int8 per "
        "output channel, int4 in groups of 128, as `nanovllm quantize`); a quantized checkpoint (compressed-tensors, "
        "AWQ, GPTQ) needs nothing, but one whose config.json lacks quantization_config needs its format named (gptq, "
        "awq: read from quantize_config.json or quant_config.json)", aliases=("-q",))
    device: str = option("auto", "auto (CUDA when available), cpu, cuda or cuda:N")
    # Tensor parallelism (docs/design.md, "Tensor parallelism"); see ParallelConfig.
    tensor_parallel_size: int = option(1, "split the model over this many GPUs (processes on CPU)", aliases=("-tp",))
    distributed_backend: str | None = option(None, "nccl or gloo (default: nccl on CUDA, gloo on CPU)",
                                             choices=("nccl", "gloo"))
    nnodes: int = option(1, "machines the tensor-parallel ranks span", aliases=("-n",), serve_only=True)
    node_rank: int = option(0, "this machine's index (0 runs the engine)", aliases=("-r",), serve_only=True)
    master_addr: str = option("127.0.0.1", "node 0's address, reachable from every node", serve_only=True)
    master_port: int | None = option(None, "node 0's rendezvous port (default: a free one; required with "
                                     "nnodes > 1)", serve_only=True)
    parallel: ParallelConfig = field(init=False, repr=False, compare=False)
    speculative: SpeculativeConfig | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # vLLM's None for these is "the platform's default": ours (code that forwards its own
        # argument parser's Nones into LLM(...) gets what vLLM would give it).
        for f in fields(self):
            if f.name in _NONE_IS_DEFAULT and getattr(self, f.name) is None:
                object.__setattr__(self, f.name, f.default)
        # The shipped models' names become their directories here, once, for every entry point.
        object.__setattr__(self, "model", resolve_builtin(self.model))
        if self.tokenizer is not None:
            object.__setattr__(self, "tokenizer", resolve_builtin(self.tokenizer))

        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "kv_cache_memory_bytes", "num_kvcache_blocks"):
            positive(name)
        if self.block_size is None:
            object.__setattr__(self, "block_size", DEFAULT_BLOCK_SIZE)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks * self.block_size > MAX_CACHE_SLOTS:
            raise ValueError(f"num_kvcache_blocks x block_size must be at most {MAX_CACHE_SLOTS} tokens, got "
                             f"{self.num_kvcache_blocks} x {self.block_size}")
        if self.seed is None:  # vLLM's: unseeded; one draw here, so every rank shares it
            object.__setattr__(self, "seed", secrets.randbelow(2**31))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_logprobs < -1 or isinstance(self.max_logprobs, bool):
            raise ValueError(f"max_logprobs must be -1 (the vocabulary size) or >= 0, got {self.max_logprobs!r}")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: the KV cache is stored in the "
                             "model's dtype (kv_cache_dtype='auto'; choose it with dtype)")
        if not self.enable_chunked_prefill:
            raise ValueError("enable_chunked_prefill=False is not supported: the scheduler always splits prompts "
                             "longer than max_num_batched_tokens over steps")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        override = self.override_generation_config
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except json.JSONDecodeError as e:
                raise ValueError(f"override_generation_config is not valid JSON: {e}") from None
        if not isinstance(override, (dict, type(None))):
            raise ValueError(f"override_generation_config must be a dict (JSON object), got {type(override).__name__}")
        object.__setattr__(self, "override_generation_config", override)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        spec = None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative", spec)
        object.__setattr__(self, "parallel", ParallelConfig(
            self.tensor_parallel_size, self.nnodes, self.node_rank, self.master_addr, self.master_port,
            self.distributed_backend))

    @classmethod
    def options(cls) -> list[Any]:
        """The option fields (everything a caller sets), in declaration order."""
        return [f for f in fields(cls) if f.init]

    @classmethod
    def python_aliases(cls) -> dict[str, str]:
        """vLLM's other names of options, as LLM(...) keywords (its `--num-gpu-blocks-override` is
        `num_gpu_blocks_override=`): alias -> the option's name."""
        return {alias[2:].replace("-", "_"): f.name for f in cls.options() for alias in f.metadata.get("aliases", ())
                if alias.startswith("--") and not alias.startswith("--no-")}

    def as_options(self) -> dict[str, Any]:
        """The options as keyword arguments (what rebuilds this object)."""
        return {f.name: getattr(self, f.name) for f in self.options()}

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available")
        return device

    def resolve(self) -> ResolvedConfig:
        """Read config.json and fill in every default: the engine's configuration."""
        model_config = load_model_config(self.model)
        device = self.resolve_device()
        window = model_config.sliding_window
        default_len = model_config.max_position_embeddings
        if window is not None and self.disable_sliding_window:
            default_len = min(default_len, window)
        max_model_len = self.max_model_len or default_len
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{model_config.max_position_embeddings}")
        if window is not None and max_model_len > window:
            # Within the window the model's attention is full attention, which the engine runs (as
            # vLLM's --disable-sliding-window caps max_model_len to the window).
            raise ValueError(f"{self.model}: sliding-window attention (a window of {window} tokens) is not supported; "
                             f"it changes nothing within max_model_len <= {window}: pass max_model_len={window} "
                             f"or disable_sliding_window=True (asked for {max_model_len})")
        # Chunked prefill splits long prompts, so the budget need not cover max_model_len.
        default = DEFAULT_BATCHED_TOKENS.get(device.type, DEFAULT_BATCHED_TOKENS["cuda"])
        if device.type == "cpu" and model_config.has_experts:
            default = DEFAULT_CPU_MOE_BATCHED_TOKENS
        budget = self.max_num_batched_tokens or max(default, self.max_num_seqs)
        draft = None
        if self.speculative is not None and self.speculative.method == "draft_model":
            draft = load_model_config(self.speculative.model)
            if draft.vocab_size != model_config.vocab_size:
                raise ValueError(f"speculative_config.model has a vocabulary of {draft.vocab_size} tokens, the model "
                                 f"{model_config.vocab_size}: a draft model must share the model's vocabulary")
        return ResolvedConfig(self, model_config, device, resolve_dtype(model_config, self.dtype, device),
                              max_model_len, budget, draft)


@dataclass(frozen=True)
class ResolvedConfig:
    """The options with every default filled in, and the model's parsed config.json."""

    options: EngineConfig
    model_config: ModelConfig
    device: torch.device  # rank 0's; a tensor-parallel worker's is rank_device()
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    draft_model_config: ModelConfig | None = None  # speculative decoding's draft model

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return self.options.speculative

    @property
    def spec_disable_batch(self) -> int:
        """No drafts while this many sequences run or wait (0: never): the option, else with
        adaptive speculation the device's default."""
        spec = self.speculative
        if spec is None:
            return 0
        if spec.disable_by_batch_size is not None:
            return spec.disable_by_batch_size
        return SPEC_AUTO_DISABLE_BATCH.get(self.device.type, SPEC_AUTO_DISABLE_BATCH["cuda"]) if spec.adaptive else 0

    @property
    def model(self) -> str:
        return self.options.model

    @property
    def block_size(self) -> int:
        size = self.options.block_size
        assert size is not None  # the options' __post_init__ resolved None to DEFAULT_BLOCK_SIZE
        return size

    @property
    def max_num_seqs(self) -> int:
        return self.options.max_num_seqs

    @property
    def parallel(self) -> ParallelConfig:
        return self.options.parallel
