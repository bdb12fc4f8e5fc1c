"""`nanovllm quantize MODEL OUT --scheme w8a16|w4a16`: round-to-nearest weight-only quantization of a
bf16 / fp32 checkpoint, written as a compressed-tensors `pack-quantized` checkpoint (what
llmcompressor writes, and transformers and vLLM read), so that a user can quantize without a GPU
toolkit.

Every linear layer of the decoder blocks (q/k/v/o, gate/up/down, and every expert's) is quantized
with layers/quantization/weights.quantize_rtn, the function `LLM(..., quantization="int8"|"int4")`
applies at load time, so both give the same weights. The embedding, the LM head and the routers of
mixture-of-experts layers stay as they are (`ignore`: config.UNQUANTIZED_MODULES). Scales are stored
in the checkpoint's dtype. Tokenizer files and everything else in MODEL are copied, except weights
in other formats (a `pytorch_model.bin` beside the safetensors files).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanovllm.builtin_code import resolve_builtin
from nanovllm.layers.quantization import compressed_tensors
from nanovllm.layers.quantization.config import SIDE_FILES, UNQUANTIZED_MODULES
from nanovllm.layers.quantization.weights import quantize_rtn
from nanovllm.models.loader import QUANTIZED_TENSORS, SAFETENSORS_INDEX, find_weight_files, validate_weight_files
from nanovllm.model_config import load_model_config
from nanovllm.models.registry import get_model_class

SCHEMES = {"w4a16": (4, 128), "w8a16": (8, None)}  # bits, default group size (None: per channel)
# The decoder blocks' linear weights by checkpoint name, the experts of mixture-of-experts layers
# included (Qwen3-MoE's mlp.experts.E.gate_proj, Mixtral's block_sparse_moe.experts.E.w1).
LINEAR = re.compile(r"^(.*\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj"
                    r"|mlp\.experts\.\d+\.(?:gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123]))\.weight$")
# Weights in other formats than safetensors, which OUT does not get (they would be the dense model).
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".bin.index.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Hugging Face checkpoint directory (bf16 or fp32), or builtin-code")
    p.add_argument("out", help="the directory to write the quantized checkpoint to (must not exist)")
    p.add_argument("--scheme", choices=sorted(SCHEMES), default="w4a16",
                   help="w4a16: int4 weights in groups of 128; w8a16: int8 weights per output channel (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=None,
                   help="input columns per scale; -1: one per output channel (default: 128 for w4a16, one per "
                        "output channel for w8a16)")
    p.add_argument("--symmetric", action="store_true", help="no zero points (default: asymmetric)")


def weights_config(bits: int, group_size: int | None, symmetric: bool) -> dict[str, Any]:
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "group_size": group_size,
            "strategy": "channel" if group_size is None else "group", "dynamic": False, "actorder": None,
            "block_structure": None, "observer": "minmax", "observer_kwargs": {}}


def quantization_config(bits: int, group_size: int | None, symmetric: bool) -> dict[str, Any]:
    """config.json's `quantization_config`, as llmcompressor writes it."""
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights_config(bits, group_size, symmetric),
                                      "input_activations": None, "output_activations": None,
                                      "format": "pack-quantized"}},
        "ignore": list(UNQUANTIZED_MODULES), "kv_cache_scheme": None, "sparsity_config": {},
    }


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, scheme: str = "w4a16",
                        group_size: int | None = None, symmetric: bool = False) -> Path:
    """Write the quantized copy of `model_dir` to `out_dir` (which must not exist yet)."""
    src, out = Path(model_dir), Path(out_dir)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}, got {scheme!r}")
    bits, default_group = SCHEMES[scheme]
    group = default_group if group_size is None else None if group_size == -1 else group_size
    if group is not None and group < 1:
        raise ValueError(f"group size must be >= 1 (or -1: per output channel), got {group}")
    config = load_model_config(src)
    get_model_class(config.architecture)  # only what nanovllm runs
    files = find_weight_files(src)
    _refuse_quantized(src, config.raw, files)
    if out.exists():
        raise ValueError(f"{out} already exists")
    made = out  # the outermost directory this call creates, removed again if it fails
    while not made.parent.exists():
        made = made.parent
    out.mkdir(parents=True)
    try:
        for item in src.iterdir():
            if item.is_file() and item.suffix != ".safetensors" and item.name not in ("config.json", SAFETENSORS_INDEX) \
                    and not item.name.endswith(OTHER_WEIGHTS):
                shutil.copy2(item, out / item.name)
        weight_map: dict[str, str] = {}
        total = 0
        for file in files:
            tensors = _quantize_file(file, bits, group, symmetric)
            save_file(tensors, str(out / file.name), metadata={"format": "pt"})
            weight_map.update({name: file.name for name in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        if (src / SAFETENSORS_INDEX).is_file():
            index = json.loads((src / SAFETENSORS_INDEX).read_text())
            index["metadata"] = {**index.get("metadata", {}), "total_size": total}
            index["weight_map"] = dict(sorted(weight_map.items()))
            (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
        raw = dict(config.raw)
        raw["quantization_config"] = quantization_config(bits, group, symmetric)
        (out / "config.json").write_text(json.dumps(raw, indent=2))
    except BaseException:
        shutil.rmtree(made, ignore_errors=True)
        raise
    return out


def _refuse_quantized(src: Path, raw: dict[str, Any], files: list[Path]) -> None:
    """A ValueError where MODEL is quantized already: its config.json says so, it has an AutoGPTQ /
    AutoAWQ side file, or a tensor only quantized checkpoints hold; or where a weight file is not
    readable (validate_weight_files), before OUT is made."""
    if "quantization_config" in raw:
        raise ValueError(f"{src} is already quantized ({raw['quantization_config'].get('quant_method')})")
    for name in sorted({n for names in SIDE_FILES.values() for n in names}):
        if (src / name).is_file():
            raise ValueError(f"{src} is already quantized ({name})")
    for file, names in validate_weight_files(files).items():
        quantized = next((name for name in names if name.endswith(QUANTIZED_TENSORS)), None)
        if quantized is not None:
            raise ValueError(f"{src} is already quantized (tensor {quantized!r} in {file.name})")


def _quantize_file(file: Path, bits: int, group: int | None, symmetric: bool) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open handles are not iterable)
            t = f.get_tensor(name)
            match = LINEAR.match(name)
            if match is None:
                tensors[name] = t
                continue
            if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"{name} in {file} is {t.dtype}: only float checkpoints can be quantized")
            try:
                w = quantize_rtn(t, bits, group, symmetric, scale_dtype=t.dtype)
            except ValueError as e:
                raise ValueError(f"{name} in {file}: {e} (choose another --group-size)") from e
            for suffix, value in compressed_tensors.pack(w, t.dtype).items():
                tensors[f"{match.group(1)}.{suffix}"] = value
    return tensors


def run(args: argparse.Namespace) -> int:
    out = quantize_checkpoint(resolve_builtin(args.model), args.out, args.scheme, args.group_size, args.symmetric)
    print(f"wrote {out}: {args.scheme}, {'symmetric' if args.symmetric else 'asymmetric'}, compressed-tensors "
          "pack-quantized")
    return 0
