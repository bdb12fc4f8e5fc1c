"""The model hyperparameters the engine needs, read from a Hugging Face `config.json`.

We parse the JSON ourselves instead of going through `transformers.AutoConfig`: the fields we need
are few, and the file format differs between transformers versions (v4 writes `rope_theta` and
`rope_scaling` at the top level and `torch_dtype`; v5 writes a `rope_parameters` dict and `dtype`).
Reading the raw file lets us accept both and report problems naming the exact file.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanovllm.cpu.features import gemm_kernel, native_bf16

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


# What models/registry.py builds (tests/test_models_loader.py checks the two agree). Checked before
# any other key: a GPT-2 or Mistral checkpoint is named as such, not as a config with a missing key.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# What transformers' config classes default to where config.json leaves a field out (where they
# differ from the rest's: rope_theta 10000, rms_norm_eps 1e-6).
_ARCH_DEFAULTS: dict[str, dict[str, float]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 131072},
    "MixtralForCausalLM": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "head_dim": 128},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768},
}
# A Hugging Face Hub id: `org/name`, no further path parts.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `scaling` holds the type-specific keys (e.g. llama3's factors)."""

    theta: float = 10000.0
    rope_type: str = "default"
    scaling: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # The window of the layers that slide (None: none does): exact as full attention only where
    # max_model_len is within it, the one case the engine runs (EngineConfig.resolve).
    sliding_window: int | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def has_experts(self) -> bool:
        """Whether layers route tokens over experts: the first of num_local_experts / num_experts (its
        alias in transformers) that config.json sets, positive, as models/moe.py reads it (which
        checks the experts' fields)."""
        count = next((v for key in ("num_local_experts", "num_experts") if (v := self.raw.get(key)) is not None), None)
        whole = whole_number(count)
        return whole is not None and whole > 0


def whole_number(value: Any) -> int | None:
    """`value` as an int where config.json gives an integer (or an integral float, as some writers
    do: 32768.0); None for anything else (a string, a boolean, null, 1.5)."""
    if isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read `<model_dir>/config.json`. Raises FileNotFoundError / ValueError naming the path."""
    path = Path(model_dir)
    if not path.is_dir():
        hint = ""
        if _HUB_ID.fullmatch(str(model_dir)) and not path.exists():
            hint = (f" ({str(model_dir)!r} looks like a Hugging Face Hub id: downloads are not supported: pass a local "
                    f"directory, e.g. after `huggingface-cli download {model_dir} --local-dir DIR`)")
        raise FileNotFoundError(f"model directory not found: {path}{hint}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"config.json not found in model directory: {cfg_file}")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid JSON in {cfg_file}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object at the top level")  # noqa: TRY004
    return parse_model_config(raw, path)


def parse_model_config(raw: dict[str, Any], model_dir: Path) -> ModelConfig:
    where = model_dir / "config.json"

    def need(key: str) -> Any:
        if key not in raw or raw[key] is None:
            raise ValueError(f"{where}: missing required key {key!r}")
        return raw[key]

    def integer(key: str, value: Any, low: int = 1) -> int:
        # A string or a boolean is an error naming the key, here, before transformers' tokenizer
        # loading parses the file with errors of its own.
        whole = whole_number(value)
        if whole is None or whole < low:
            raise ValueError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
        return whole

    def number(key: str, default: float) -> float:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
        return float(value)

    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ValueError(f"{where}: missing 'architectures' (e.g. ['Qwen3ForCausalLM'])")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{where}: unsupported model architecture {archs[0]!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")

    defaults = _ARCH_DEFAULTS.get(archs[0], {})
    hidden_size = integer("hidden_size", need("hidden_size"))
    num_heads = integer("num_attention_heads", need("num_attention_heads"))
    # `head_dim` is explicit in Qwen3 (and may differ from hidden/heads); older configs omit it,
    # which Qwen3Config reads as 128, the others as hidden / heads (null too).
    head_dim = integer("head_dim", raw.get("head_dim") or (
        defaults.get("head_dim") if "head_dim" not in raw else None) or hidden_size // num_heads)
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' "swish" is SiLU; vLLM refuses the others too
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
    num_kv_heads = integer("num_key_value_heads", raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{where}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    num_layers = integer("num_hidden_layers", need("num_hidden_layers"), low=0)
    max_positions = raw.get("max_position_embeddings") or int(defaults.get("max_position_embeddings", 2048))
    window = _sliding_window(raw, num_layers)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{where}: sliding_window must be null or a positive integer, got {window!r}")

    return ModelConfig(
        model_dir=model_dir,
        architecture=str(archs[0]),
        model_type=str(raw.get("model_type", "")),
        vocab_size=integer("vocab_size", need("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=integer("intermediate_size", need("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=number("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=integer("max_position_embeddings", max_positions),
        rope=_parse_rope(raw, defaults.get("rope_theta", 10000.0), max_positions),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=_parse_dtype(raw.get("torch_dtype") or raw.get("dtype") or "float32", where),
        # generation_config.json may name more end tokens (Qwen's <|im_end|>, Llama 3's <|eot_id|>):
        # vLLM stops on those too.
        eos_token_ids=end_tokens(raw, model_dir),
        bos_token_id=raw.get("bos_token_id"),
        sliding_window=window,
        raw=raw,
    )


# transformers' defaults where a Qwen config turns sliding windows on without giving them: the
# window, and the first layer that slides (Qwen2 and Qwen3).
_QWEN_DEFAULT_WINDOW, _QWEN_DEFAULT_MAX_WINDOW_LAYERS = 4096, 28
# The model types whose transformers classes read `sliding_window`: Qwen's only with
# use_sliding_window (default false), Mistral's and Mixtral's as given; the others (Llama) ignore it.
_QWEN_TYPES = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
_WINDOW_TYPES = frozenset({"mistral", "mixtral"})


def _sliding_window(raw: dict[str, Any], num_layers: int) -> Any:
    """The attention window of the layers that slide, as transformers reads config.json; None where
    no layer does. Qwen2/3 slide the layers from max_window_layers on (or those layer_types names);
    a window of 0 is none (vLLM's rule: some checkpoints write 0 for "no window")."""
    model_type = raw.get("model_type")
    if model_type in _QWEN_TYPES:
        window = raw.get("sliding_window", _QWEN_DEFAULT_WINDOW) if raw.get("use_sliding_window") else None
    elif model_type in _WINDOW_TYPES:
        # MistralConfig's default window where config.json leaves the key out (Mixtral's is none).
        window = raw.get("sliding_window", 4096 if model_type == "mistral" else None)
    else:
        return None
    if window is None or window == 0:
        return None
    types = raw.get("layer_types")
    if isinstance(types, list):
        return window if "sliding_attention" in types else None
    if model_type in ("qwen2", "qwen3"):
        first = whole_number(raw.get("max_window_layers", _QWEN_DEFAULT_MAX_WINDOW_LAYERS))
        if first is not None and first >= num_layers:
            return None
    return window


def _parse_rope(raw: dict[str, Any], default_theta: float, max_positions: Any) -> RopeConfig:
    # v5: {"rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}}
    # v4: {"rope_theta": ..., "rope_scaling": {"rope_type" or "type": ..., ...} or null}
    # A rope_scaling (v4) replaces rope_parameters whole, as transformers 5 reads both.
    params: dict[str, Any] = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or default_theta
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type in ("llama3", "yarn"):
        # transformers' standardize_rope_params: the pretraining length a top-level field gives
        # (Phi-3's) wins, else the scaling's own, else max_position_embeddings.
        if raw.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", max_positions)
        params.setdefault("max_position_embeddings", max_positions)  # YaRN without a factor
    return RopeConfig(theta=float(theta), rope_type=str(rope_type), scaling=params)


def _parse_dtype(value: Any, where: Path) -> torch.dtype:
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"{where}: unsupported dtype {value!r} (supported: {sorted(_DTYPES)})")
    return _DTYPES[name]


def end_tokens(raw: dict[str, Any], generation_dir: Path) -> tuple[int, ...]:
    """config.json's eos_token_id(s) (`raw`), then those of generation_config.json in `generation_dir`
    (the model's directory, or vLLM's generation_config directory)."""
    return tuple(dict.fromkeys(_as_id_tuple(raw.get("eos_token_id")) + _generation_eos(generation_dir)))


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file at `path`; ValueError naming the path where it cannot be read or
    holds something else (the model directory's side files: generation_config.json, a quantized
    checkpoint's quantize_config.json)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} as a JSON object: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"cannot read {path} as a JSON object: it holds a {type(raw).__name__}")
    return raw


def _generation_config(directory: Path) -> dict[str, Any] | None:
    """generation_config.json in `directory` as an object; None where there is none. ValueError
    where it is not a readable JSON object (its readers decide what that costs)."""
    path = directory / "generation_config.json"
    return read_json_object(path) if path.is_file() else None


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id(s); none where the file is absent or unreadable (it
    only adds end tokens, as vLLM reads it)."""
    try:
        return _as_id_tuple((_generation_config(model_dir) or {}).get("eos_token_id"))
    except (TypeError, ValueError):
        return ()


# generation_config.json's fields that become default sampling parameters (vLLM's
# get_diff_sampling_param); max_new_tokens is max_tokens.
SAMPLING_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                   "min_p", "max_new_tokens")


def sampling_defaults(model_dir: str | Path, source: str = "auto",
                      override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling parameters a request that leaves them out gets, by SamplingParams' names (vLLM's
    --generation-config): those generation_config.json sets (`source` "auto": the model's; a
    directory: its file; "vllm": none), with `override`'s over them. ValueError for a directory
    without the file or whose file is not a JSON object (the model's own such file: a warning)."""
    raw: dict[str, Any] | None = {}
    if source != "vllm":
        directory = Path(model_dir) if source == "auto" else Path(source)
        try:
            raw = _generation_config(directory)
        except ValueError as e:
            if source != "auto":
                raise
            # The model's own file: as vLLM (try_get_generation_config), no defaults rather than no model.
            logger.warning("%s: no default sampling parameters from it", e)
            raw = {}
        if raw is None and source != "auto":
            raise ValueError(f"generation_config={source!r}: {directory / 'generation_config.json'} does not exist "
                             "(give 'auto', 'vllm' or a directory holding a generation_config.json)")
    raw = {**(raw or {}), **(override or {})}
    diff = {name: raw[name] for name in SAMPLING_FIELDS if raw.get(name) is not None}
    if "max_new_tokens" in diff:
        diff["max_tokens"] = diff.pop("max_new_tokens")
    return diff


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def resolve_dtype(config: ModelConfig, dtype: str | torch.dtype = "auto",
                  device: torch.device | str = "cpu") -> torch.dtype:
    """`"auto"` means the checkpoint's dtype; otherwise a torch dtype or its name ("bfloat16").

    On CPU: float16 has no kernels (a clear error when asked for; an fp16 checkpoint under "auto"
    runs in float32, which holds every fp16 value exactly). A bf16 checkpoint under "auto" stays
    bf16 where the CPU computes bf16 natively and runs in float32 elsewhere; an explicit
    "bfloat16" runs anyway: without those instructions its linear layers multiply in float32
    arithmetic (cpu/gemm.py), on the bf16 weights with our AVX2 GEMM, on float32 copies of
    them (with a warning: twice the weight memory) with oneDNN.
    """
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = config.torch_dtype
    else:
        name = dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r} (use 'auto' or one of {sorted(_DTYPES)})")
        resolved = _DTYPES[name]
    if torch.device(device).type != "cpu" or resolved == torch.float32:
        return resolved
    auto = dtype == "auto"
    if resolved == torch.float16:
        if not auto:
            raise ValueError("float16 is not supported on CPU: use dtype='bfloat16' or 'float32'")
        logger.info("float16 checkpoint on CPU: running in float32 (no float16 CPU kernels)")
        return torch.float32
    if resolved == torch.bfloat16 and not native_bf16():
        if auto:
            logger.info("bfloat16 checkpoint on a CPU without AVX512-BF16/AMX: running in float32 (its GEMMs compute "
                        "in float32 either way, so bfloat16 would only round more)")
            return torch.float32
        if gemm_kernel() == "avx2":
            logger.info("bfloat16 on a CPU without AVX512-BF16/AMX: the linear layers widen their bf16 weights "
                        "to float32 in registers (csrc/cpu_gemm.cpp)")
        else:
            logger.warning("bfloat16 on a CPU without AVX512-BF16/AMX: the linear layers multiply in float32 on "
                           "float32 copies of their weights (emulated bf16 GEMMs are 5-10x slower), so the "
                           "weights take as much memory as in float32; the KV cache and activations stay bfloat16")
    return resolved
