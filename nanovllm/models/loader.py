"""Load Hugging Face safetensors checkpoints into our models.

Only `*.safetensors` is accepted: pickle-based `.bin` checkpoints can execute code on load. Every
checkpoint tensor must map to exactly one parameter (or packed shard) and every parameter must be
filled; anything else is an error naming the tensor and the file, so a wrong or damaged
checkpoint fails loudly instead of leaving random weights in the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.layers.linear import ShardId, get_weight_loader
from nanovllm.layers.quantization.config import QuantConfig, resolve_quant_config
from nanovllm.layers.quantization.linear_method import finish_model, prepare_model
from nanovllm.model_config import ModelConfig, load_model_config, resolve_dtype
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.registry import ARCH_CONFIGS, build_model


@dataclass(frozen=True)
class _Target:
    param_name: str
    shard_id: ShardId


SAFETENSORS_INDEX = "model.safetensors.index.json"


def find_weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names where it has one (as transformers
    reads it: Mistral's repositories keep their own `consolidated.safetensors` beside the shards),
    else every one in the directory."""
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        return _indexed_files(index)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
            raise ValueError(
                f"{path} has only pickle checkpoints (.bin/.pt); safetensors is required "
                "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))"
            )
        raise FileNotFoundError(f"no *.safetensors weight files in {path}")
    return files


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"cannot read the checkpoint index {index}: {e}") from e
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to file names")
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{index} names weight files that are not there: {', '.join(missing[:5])}")
    return files


def validate_weight_files(files: list[Path]) -> dict[Path, list[str]]:
    """Check that every file is a readable safetensors file, before any memory is reserved; returns
    each file's tensor names.

    Reads only the headers: a truncated or corrupt file (header damaged, or data not covering
    what the header declares) raises ValueError naming the file.
    """
    names: dict[Path, list[str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names[file] = list(f.keys())  # noqa: SIM118  (safe_open handles are not iterable)
                for name in names[file]:
                    f.get_slice(name).get_shape()
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise ValueError(f"cannot read safetensors file {file}: {e}") from e
    return names


def checkpoint_targets(model: DecoderForCausalLM) -> dict[str, _Target]:
    """Every checkpoint tensor name the model expects -> the parameter (and shard) it fills."""
    packed: dict[str, list[tuple[str, ShardId]]] = {}
    for ckpt_module, (our_module, shard) in model.packed_modules_mapping.items():
        packed.setdefault(our_module, []).append((ckpt_module, shard))
    renamed = model.checkpoint_module_names

    def checkpoint_name(parts: list[str]) -> str:
        return ".".join(renamed.get(p, p) for p in parts)

    targets: dict[str, _Target] = {}
    # named_parameters() lists a tied weight once, under the embedding's name.
    for name, param in model.named_parameters():
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        shards: list[tuple[str, ShardId]] | None = getattr(param, "checkpoint_shards", None)
        if shards is not None:  # one parameter filled from many tensors, e.g. every expert's weight
            for suffix, shard_id in shards:
                targets[checkpoint_name([*parts[:-1], *suffix.split(".")])] = _Target(name, shard_id)
        elif module in packed:
            for ckpt_module, shard_id in packed[module]:
                targets[checkpoint_name([*parts[:-2], ckpt_module, parts[-1]])] = _Target(name, shard_id)
        else:
            targets[checkpoint_name(parts)] = _Target(name, None)
    return targets


# The tensors only a quantized checkpoint holds (AWQ's and GPTQ's, compressed-tensors' pack-quantized).
QUANTIZED_TENSORS = (".qweight", ".qzeros", ".g_idx", ".weight_packed", ".weight_zero_point", ".weight_scale")


def _quantized_hint(model: DecoderForCausalLM, name: str) -> str:
    """Where a quantized checkpoint's tensor meets a model loading unquantized: what is missing."""
    if not name.endswith(QUANTIZED_TENSORS) or any(getattr(m, "quant", None) is not None for m in model.modules()):
        return ""
    return ("; the checkpoint looks quantized but config.json has no quantization_config: an AutoGPTQ or AutoAWQ "
            "checkpoint keeps it in quantize_config.json or quant_config.json, read with quantization='gptq' or "
            "'awq'")


def load_weights(model: DecoderForCausalLM, model_dir: str | Path, skipped: tuple[str, ...] = ()) -> None:
    """Fill every parameter of `model` from the safetensors files in `model_dir`; tensors whose names
    end with one of `skipped` are passed over (QuantConfig.skipped_tensors)."""
    files = find_weight_files(model_dir)
    targets = checkpoint_targets(model)
    params = dict(model.named_parameters())
    ignored_names = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    passed_over = (*model.ignored_checkpoint_suffixes, *skipped)
    loaded: dict[str, Path] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for damaged headers
            raise ValueError(f"cannot read safetensors file {file}: {e}") from e
        with handle as f:
            for name in f.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                if name in ignored_names or name.endswith(passed_over):
                    continue
                target = targets.get(name)
                if target is None and _zero_bias_of_unbiased_layer(name, targets, f):
                    continue
                if target is None:
                    raise ValueError(f"unexpected tensor {name!r} in {file} (not part of the model)"
                                     f"{_quantized_hint(model, name)}")
                if name in loaded:
                    raise ValueError(f"tensor {name!r} appears in both {loaded[name]} and {file}")
                param = params[target.param_name]
                try:
                    # A lazy slice: the weight loader reads only the part this rank keeps.
                    get_weight_loader(param)(param, f.get_slice(name), target.shard_id)
                except ValueError as e:
                    raise ValueError(f"tensor {name!r} in {file}: {e}") from e
                except Exception as e:  # safetensors' own errors for unreadable data
                    raise ValueError(f"cannot read tensor {name!r} from {file}: {e}") from e
                loaded[name] = file
    missing = sorted(name for name in set(targets) - set(loaded)
                     if not getattr(params[targets[name].param_name], "optional_in_checkpoint", False))
    if missing:
        shown = ", ".join(repr(m) for m in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise ValueError(f"checkpoint in {Path(model_dir)} is missing tensors: {shown}{more}")


def _zero_bias_of_unbiased_layer(name: str, targets: dict[str, _Target], f: Any) -> bool:
    """Whether checkpoint tensor `name` is a bias of zeros for a layer of the model that has none:
    older GPTQ writers (AutoGPTQ) store one for every linear layer, and vLLM skips them. A bias
    that is not zero would change the model: the caller reports it as an unexpected tensor."""
    if not name.endswith(".bias"):
        return False
    layer = name.removesuffix("bias")
    if not any(t.startswith(layer) for t in targets):
        return False
    try:
        return not f.get_tensor(name).any()
    except Exception:  # noqa: BLE001  (an unreadable tensor: reported as unexpected, naming it)
        return False


def check_model_config(config: ModelConfig, quantization: str | None = None) -> QuantConfig | None:
    """config.json's architecture-specific fields (a mixture of experts') and its quantization config
    (returned) against the engine's `quantization` option, parsed as building and loading the model
    will: a malformed file is a ValueError naming it and the field. The engine calls it before it
    loads the tokenizer, which parses config.json with transformers, whose errors name neither."""
    arch = ARCH_CONFIGS.get(config.architecture)
    if arch is not None:
        arch(config)
    return resolve_quant_config(config.raw, quantization, str(Path(config.model_dir) / "config.json"),
                                Path(config.model_dir))


def load_model_from_config(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                           attn_backend: str = "torch", tp: TPGroup | None = None,
                           quantization: str | None = None) -> DecoderForCausalLM:
    """Build `config`'s architecture in `dtype` and load its weights (this rank's shards under tensor
    parallelism `tp`) from the checkpoint beside its config.json. `quantization`: a load-time scheme
    ("int8", "int4") for an unquantized checkpoint, or the format a quantized one must have
    (layers/quantization)."""
    quant = check_model_config(config, quantization)
    # Every file's header is checked before the model takes any memory: a truncated shard fails
    # here, naming the file, not halfway through the load.
    stored = validate_weight_files(find_weight_files(config.model_dir))
    model = build_model(config, dtype, device, attn_backend, tp)
    if quant is not None:
        prepare_model(model, quant, {name for names in stored.values() for name in names})
    load_weights(model, config.model_dir, quant.skipped_tensors if quant is not None else ())
    if quant is not None:
        finish_model(model, quant, torch.device(device))
    return model


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    attn_backend: str = "torch",
    tp: TPGroup | None = None,
    quantization: str | None = None,
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Read config.json, then `load_model_from_config` with `dtype` resolved against it (the engine
    resolves its configuration once and calls that directly). Returns (model, config)."""
    config = load_model_config(model_dir)
    model = load_model_from_config(config, resolve_dtype(config, dtype, device), device, attn_backend, tp, quantization)
    return model, config
