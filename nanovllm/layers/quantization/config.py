"""Which weights of a model are quantized and how: read from `quantization_config` in config.json
(compressed-tensors, AWQ, GPTQ), from the file older AutoGPTQ / AutoAWQ checkpoints keep it in
(quantize_config.json, quant_config.json) when `quantization` names their format, or asked for at
load time (`LLM(..., quantization="int8"|"int4")`).

Only what nanovllm runs is accepted; anything else is a ValueError naming the scheme, raised when
the model is loaded, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nanovllm.layers.quantization import awq, compressed_tensors, gptq
from nanovllm.layers.quantization.weights import BITS, QuantizedWeight
from nanovllm.model_config import read_json_object, whole_number

# `LLM(quantization=...)` values that quantize an unquantized checkpoint while it loads
# (round to nearest), with `nanovllm quantize`'s defaults: (bits, group size (None: per channel)).
LOAD_TIME_SCHEMES: dict[str, tuple[int, int | None]] = {"int8": (8, None), "int4": (4, 128)}
CHECKPOINT_METHODS = ("compressed-tensors", "awq", "gptq")
# vLLM's other names for these formats (its GPU kernels, AutoGPTQ's and AutoAWQ's): the same checkpoints.
METHOD_ALIASES = {"gptq_marlin": "gptq", "auto_gptq": "gptq", "awq_marlin": "awq", "auto_awq": "awq"}
# Where a checkpoint whose config.json has no quantization_config keeps it (AutoGPTQ's and
# AutoAWQ's older output), read when `quantization` names the format, as vLLM reads them, and the
# keys such a file must hold (each a tuple of spellings), as vLLM requires them: AWQ reads
# quantize_config.json too, which an AutoGPTQ checkpoint's is, and without them took it as AWQ.
SIDE_FILES: dict[str, tuple[str, ...]] = {"gptq": ("quantize_config.json",),
                                          "awq": ("quant_config.json", "quantize_config.json")}
SIDE_FILE_KEYS: dict[str, tuple[tuple[str, ...], ...]] = {
    "gptq": (("bits",), ("group_size",), ("desc_act",), ("sym",)),
    "awq": (("w_bit", "bits"), ("q_group_size", "group_size"), ("zero_point",)),
}
# What quantizing a model leaves in its own dtype: the LM head, and the routers of mixture-of-experts
# layers (Qwen3-MoE's `mlp.gate`, Mixtral's `block_sparse_moe.gate`), whose few weights decide which
# experts run: rounding them moves tokens to other experts for no bandwidth saved (llmcompressor's
# MoE recipes ignore them too).
# AutoAWQ and GPTQModel leave the routers dense too, without always listing them.
MOE_ROUTERS = (r"re:.*\.mlp\.gate$", r"re:.*\.block_sparse_moe\.gate$")
UNQUANTIZED_MODULES = ("lm_head", *MOE_ROUTERS)
# The attention layers' KV cache scales of a checkpoint with a kv_cache_scheme (compressed-tensors'
# names, and llm-compressor's older output scales of k_proj / v_proj).
KV_CACHE_SCALES = (".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.q_scale", ".k_proj.output_scale",
                   ".v_proj.output_scale")


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How one linear layer's weight is stored."""
    bits: int
    group_size: int | None  # None: one scale per output channel
    symmetric: bool
    actorder: bool = False  # the checkpoint has a g_idx (activation order)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    method: str  # "compressed-tensors" | "awq" | "gptq" | "rtn" (quantized at load time)
    # (targets, scheme) per compressed-tensors target or GPTQ `dynamic` rule, then the method's
    # default; scheme None: stored unquantized (a GPTQ "-:" rule). scheme_for picks among them.
    groups: tuple[tuple[tuple[str, ...], WeightScheme | None], ...]
    ignore: tuple[str, ...] = ()
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # format details (GPTQ's zero offset)
    # When set, only the modules whose names contain one of these are quantized (GPTQ's
    # modules_in_block_to_quantize).
    only: tuple[str, ...] = ()
    # Checkpoint tensors (name suffixes) that are not read: a compressed-tensors kv_cache_scheme's
    # scales, for a KV cache nanovllm keeps in the model's dtype (as vLLM's kv_cache_dtype="auto").
    skipped_tensors: tuple[str, ...] = ()

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of the checkpoint's linear module `module` (e.g. "model.layers.0.mlp.up_proj"),
        None when it is stored unquantized. Of the targets that match it, a name beats a regex and a
        regex beats the class ("Linear"), as compressed-tensors picks; among regexes, compressed-tensors
        takes the first in sorted order (match_targets sorts them), GPTQ's dynamic rules the first given."""
        if any(_match_rank(pattern, module) is not None for pattern in self.ignore):
            return None
        if self.only and not any(name in module for name in self.only):
            return None
        by_name = self.method == "compressed-tensors"
        best: tuple[tuple[int, str], WeightScheme | None] | None = None
        for targets, scheme in self.groups:
            for target in targets:
                rank = _match_rank(target, module)
                key = (rank, target if by_name else "")
                if rank is not None and (best is None or key < best[0]):
                    best = (key, scheme)
        return None if best is None else best[1]

    def tensor_names(self, scheme: WeightScheme) -> tuple[str, ...]:
        """The checkpoint tensors (name suffixes) of one quantized linear module."""
        if self.method == "compressed-tensors":
            return compressed_tensors.tensor_names(scheme.symmetric, scheme.actorder)
        if self.method == "awq":
            return awq.TENSOR_NAMES
        if self.method == "gptq":
            return gptq.TENSOR_NAMES
        return ("weight",)  # a load-time scheme reads the dense weight and rounds it (linear_method)

    def optional_tensors(self, scheme: WeightScheme) -> tuple[str, ...]:
        """Those of tensor_names a checkpoint may leave out: GPTQ's g_idx without desc_act (each
        row's group is then its index // group_size; vLLM never reads it there)."""
        return ("g_idx",) if self.method == "gptq" and not scheme.actorder else ()

    def unpack(self, tensors: Mapping[str, torch.Tensor], scheme: WeightScheme, out_features: int,
               in_features: int, where: str) -> QuantizedWeight:
        """One module's checkpoint tensors -> its QuantizedWeight ([out_features, in_features])."""
        if self.method == "compressed-tensors":
            return compressed_tensors.unpack(tensors, scheme.bits, _group(scheme, in_features), scheme.symmetric,
                                             out_features, in_features, where)
        if self.method == "awq":
            return awq.unpack(tensors, scheme.bits, _group(scheme, in_features), out_features, in_features, where)
        if self.method == "gptq":
            return gptq.unpack(tensors, scheme.bits, _group(scheme, in_features), scheme.symmetric,
                               int(self.extra.get("zero_offset", 1)), out_features, in_features, where)
        raise ValueError(f"{self.method} quantization has no checkpoint tensors")


def _group(scheme: WeightScheme, in_features: int) -> int:
    """The group size over `in_features` columns: a group wider than them is one group, all of them
    (the formats store ceil(in / group) groups)."""
    return in_features if scheme.group_size is None else min(scheme.group_size, in_features)


def _match_rank(pattern: str, module: str) -> int | None:
    """How `pattern` matches `module` as compressed-tensors (and vLLM) match targets and ignore
    entries: 0 the module's whole name, 1 "re:<regex>" from the start of the name, 2 "Linear" (the
    class of every layer nanovllm quantizes); None when it does not."""
    if pattern.startswith("re:"):
        return 1 if re.match(pattern[3:], module) is not None else None
    if pattern == "Linear":
        return 2
    return 0 if module == pattern else None


def _containing(names: Any, where: str, what: str) -> tuple[str, ...]:
    """AWQ's and GPTQ's modules_to_not_convert: each entry leaves every module whose name contains
    it unquantized (vLLM's, AutoAWQ's and GPTQModel's reading), as regex targets."""
    if names is None:
        return ()
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: {what} modules_to_not_convert must be a list of names, got {names!r}")
    return tuple(f"re:.*{re.escape(n)}" for n in names)


def load_time_config(name: str) -> QuantConfig:
    if name not in LOAD_TIME_SCHEMES:
        raise ValueError(f"quantization must be one of {sorted(LOAD_TIME_SCHEMES)} to quantize while loading "
                         f"(or {', '.join(CHECKPOINT_METHODS)} naming a quantized checkpoint's own format), got {name!r}")
    bits, group_size = LOAD_TIME_SCHEMES[name]
    return QuantConfig("rtn", ((("Linear",), WeightScheme(bits, group_size, symmetric=False)),),
                       UNQUANTIZED_MODULES)


def resolve_quant_config(raw: Mapping[str, Any], requested: str | None, where: str,
                         model_dir: Path | None = None) -> QuantConfig | None:
    """The model's QuantConfig from config.json's `quantization_config` (`raw` is the whole
    config.json, read from `where`) and the engine's `quantization` option: a load-time scheme for an
    unquantized checkpoint, or a format name that must match the checkpoint's. A format name for a
    config.json without quantization_config reads the format's file in `model_dir` (SIDE_FILES)."""
    asked = requested  # as the user spelled it, for messages
    if requested is not None:
        requested = METHOD_ALIASES.get(requested, requested)
    qc = raw.get("quantization_config")
    if qc is None:
        if requested is None:
            return None
        if requested not in CHECKPOINT_METHODS:
            side = [n for n in dict.fromkeys(n for names in SIDE_FILES.values() for n in names)
                    if model_dir is not None and (model_dir / n).is_file()]
            if side:
                raise ValueError(f"quantization={asked!r} quantizes an unquantized checkpoint while loading, but "
                                 f"{model_dir} holds {side[0]} (an AutoGPTQ / AutoAWQ checkpoint): run it as "
                                 "stored with quantization='gptq' or 'awq'")
            return load_time_config(requested)
        qc, where = side_config(requested, asked, where, model_dir)
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if requested is not None and requested != method:
        raise ValueError(f"quantization={asked!r}, but {where} is quantized with {method!r}: a quantized "
                         "checkpoint runs as it is stored (leave quantization unset)")
    if method == "compressed-tensors":
        return _compressed_tensors_config(qc, where)
    if method == "awq":
        return _awq_config(qc, where)
    if method == "gptq":
        return _gptq_config(qc, where)
    raise ValueError(f"{where}: quantization method {method!r} is not supported (supported: "
                     f"{', '.join(CHECKPOINT_METHODS)})")


def side_config(method: str, asked: str | None, where: str, model_dir: Path | None) -> tuple[dict[str, Any], str]:
    """The quantization config of a `method` checkpoint (`asked`: the option as spelled) whose
    config.json (`where`) has none, from the one file of SIDE_FILES[method] in `model_dir`, with the
    file's path (for messages)."""
    names = SIDE_FILES.get(method, ())
    found = [model_dir / name for name in names if model_dir is not None and (model_dir / name).is_file()]
    if not found:
        beside = f" and its directory no {' or '.join(names)}" if names else ""
        raise ValueError(f"quantization={asked!r}, but {where} has no quantization_config{beside}")
    if len(found) > 1:
        raise ValueError(f"quantization={asked!r}: {model_dir} holds both {' and '.join(f.name for f in found)}; "
                         "which one configures the checkpoint is ambiguous (remove the other)")
    qc = read_json_object(found[0])
    missing = [" or ".join(spellings) for spellings in SIDE_FILE_KEYS[method] if not any(k in qc for k in spellings)]
    if missing and (qc.get("quant_method") or method) == method:
        raise ValueError(f"quantization={asked!r}: {found[0]} lacks the {method.upper()} config's "
                         f"{', '.join(missing)} (another format's file?)")
    # The files rarely name their format (null is none); one that names another is refused by the caller.
    return {**qc, "quant_method": qc.get("quant_method") or method}, str(found[0])


def _first_given(qc: Mapping[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    """The value of the first of `keys` that `qc` sets (not null), else `default`."""
    return next((qc[k] for k in keys if qc.get(k) is not None), default)


def _flag(value: Any, where: str, what: str, field: str) -> bool:
    """A boolean field: true / false, null (false, as vLLM reads it), or a JSON string of one ("false"
    would otherwise read as true)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{where}: {what}: {field} must be true or false, got {value!r}")


def _integer(value: Any, where: str, what: str, field: str) -> int:
    """model_config's whole_number; anything else a ValueError naming the field."""
    whole = whole_number(value)
    if whole is None:
        raise ValueError(f"{where}: {what}: {field} must be an integer, got {value!r}")
    return whole


def _group_size(value: Any, where: str, what: str) -> int | None:
    """A group size: >= 1, or -1 (AWQ, GPTQ: one group per output channel, returned as None)."""
    size = _integer(value, where, what, "group_size")
    if size == -1:
        return None
    if size < 1:
        raise ValueError(f"{where}: {what}: group_size must be >= 1 (or -1), got {size}")
    return size


def _bits(value: Any, where: str, what: str, field: str = "bits") -> int:
    bits = _integer(value, where, what, field)
    if bits not in BITS:
        raise ValueError(f"{where}: {what} with {bits}-bit weights is not supported (4 or 8 bits)")
    return bits


def _compressed_tensors_config(qc: Mapping[str, Any], where: str) -> QuantConfig:
    top_format = qc.get("format")
    schemes: dict[str, WeightScheme] = {}
    config_groups = qc.get("config_groups") or {}
    if not isinstance(config_groups, dict):
        raise ValueError(f"{where}: compressed-tensors config_groups must be an object, got {config_groups!r}")
    for name, group in config_groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights") or {}, dict):
            raise ValueError(f"{where}: compressed-tensors group {name!r} must be an object with a 'weights' object")
        fmt = group.get("format") or top_format
        what = f"compressed-tensors group {name!r} (format {fmt!r})"
        if fmt != "pack-quantized":
            raise ValueError(f"{where}: {what} is not supported: only 'pack-quantized' (weight-only int4/int8)")
        if group.get("input_activations") is not None or group.get("output_activations") is not None:
            raise ValueError(f"{where}: {what} quantizes activations: not supported (only weight-only "
                             "schemes: W4A16, W8A16)")
        # compressed-tensors' enums take any case ("GROUP", "Int"), as its QuantizationArgs reads them.
        w = {k: v.lower() if k in ("type", "strategy", "actorder") and isinstance(v, str) else v
             for k, v in (group.get("weights") or {}).items()}
        if w.get("type", "int") != "int" or w.get("dynamic", False):
            raise ValueError(f"{where}: {what}: weights of type {w.get('type')!r} (dynamic={w.get('dynamic')}) are "
                             "not supported; only static int weights")
        strategy = w.get("strategy")
        if strategy is None and w.get("group_size") is not None:  # compressed-tensors infers it
            strategy = "channel" if w.get("group_size") == -1 else "group"
        if strategy not in ("group", "channel"):
            raise ValueError(f"{where}: {what}: weight strategy {strategy!r} is not supported (group, channel)")
        group_size = _group_size(w.get("group_size"), where, what) if strategy == "group" else None
        if strategy == "group" and group_size is None:
            raise ValueError(f"{where}: {what}: the group strategy needs a group_size >= 1, got -1")
        actorder = w.get("actorder")
        if actorder not in (None, False, "group", "weight", "static", "dynamic"):
            raise ValueError(f"{where}: {what}: actorder {actorder!r} is not supported")
        # "dynamic" is compressed-tensors' other name for "group": a g_idx is stored.
        scheme = WeightScheme(_bits(w.get("num_bits", 8), where, what, "num_bits"), group_size,
                              _flag(w.get("symmetric", True), where, what, "symmetric"), actorder in ("group", "dynamic"))
        # A target named again by a later group takes that group's scheme (compressed-tensors).
        for target in group.get("targets") or ():
            schemes[target] = scheme
    if not config_groups:
        raise ValueError(f"{where}: compressed-tensors quantization_config has no config_groups")
    _refuse_online_transforms(qc.get("transform_config"), where)
    sparsity = qc.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
        raise ValueError(f"{where}: compressed-tensors sparsity_config with format {sparsity.get('format')!r} is "
                         "not supported (dense weights only)")
    config = QuantConfig("compressed-tensors", tuple(((t,), s) for t, s in schemes.items()),
                         tuple(qc.get("ignore") or ()),
                         skipped_tensors=KV_CACHE_SCALES if qc.get("kv_cache_scheme") is not None else ())
    if config.scheme_for("lm_head") is not None:
        raise ValueError(f"{where}: a quantized LM head is not supported (ignore 'lm_head' when quantizing)")
    return config


def _awq_config(qc: Mapping[str, Any], where: str) -> QuantConfig:
    # transformers 5 names the packing `format`; `version` (AutoAWQ's) wins where both are given, as there.
    version = str(_first_given(qc, ("version", "format"), "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}: AWQ version {version!r} is not supported: only 'gemm' packing")
    if not _flag(qc.get("zero_point", True), where, "AWQ", "zero_point"):
        raise ValueError(f"{where}: AWQ without zero points is not supported (GEMM packing stores them)")
    bits = _bits(qc.get("bits", qc.get("w_bit", 4)), where, "AWQ")
    if bits != 4:
        raise ValueError(f"{where}: AWQ with {bits}-bit weights is not supported (GEMM packing is 4-bit)")
    scheme = WeightScheme(bits, _group_size(qc.get("group_size", qc.get("q_group_size", 128)), where, "AWQ"),
                          symmetric=False)
    return QuantConfig("awq", ((("Linear",), scheme),),
                       (*_containing(qc.get("modules_to_not_convert"), where, "AWQ"), *MOE_ROUTERS))


def _gptq_config(qc: Mapping[str, Any], where: str) -> QuantConfig:
    # AutoGPTQ (0.7.1 and before) marks Marlin's repacked checkpoints with is_marlin_format instead.
    # transformers 5 names it `format`; `checkpoint_format` (the older key) wins where both are given, as there.
    fmt = ("marlin" if _flag(qc.get("is_marlin_format", False), where, "GPTQ", "is_marlin_format")
           else str(_first_given(qc, ("checkpoint_format", "format"), "gptq")).lower())
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    if _flag(qc.get("lm_head", False), where, "GPTQ", "lm_head"):
        raise ValueError(f"{where}: a quantized LM head (GPTQ lm_head=true) is not supported")

    def scheme(fields: Mapping[str, Any], base: Mapping[str, Any], what: str) -> WeightScheme:
        def field(name: str, default: Any) -> Any:
            return fields.get(name, base.get(name, default))
        return WeightScheme(_bits(field("bits", 4), where, what), _group_size(field("group_size", 128), where, what),
                            _flag(field("sym", True), where, what, "sym"),
                            _flag(field("desc_act", False), where, what, "desc_act"))

    rules: list[tuple[tuple[str, ...], WeightScheme | None]] = []
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise ValueError(f"{where}: GPTQ dynamic must be an object of regex rules, got {dynamic!r}")
    # GPTQModel's per-module rules, the first whose regex matches (from the start) deciding: "-:" a
    # module stored unquantized, "+:" (or none) the module's bits, group_size, sym, desc_act.
    for pattern, fields in dynamic.items():
        what = f"GPTQ dynamic rule {pattern!r}"
        regex = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"{where}: {what} is not a valid regex: {e}") from e
        if not isinstance(fields, dict):
            raise ValueError(f"{where}: {what} must map to an object of overrides, got {fields!r}")
        rules.append(((f"re:{regex}",), None if pattern.startswith("-:") else scheme(fields, qc, what)))
    rules.append((("Linear",), scheme({}, qc, "GPTQ")))
    # Only the modules these name are quantized (transformers' and optimum's GPTQ configs; vLLM's
    # reading: a module whose name contains one).
    only = qc.get("modules_in_block_to_quantize") or ()
    names = [n for block in only for n in (block if isinstance(block, (list, tuple)) else [block])]
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: GPTQ modules_in_block_to_quantize must be lists of module names, got {only!r}")
    # gptq (v1) stores every zero point minus one; gptq_v2 stores it as it is.
    return QuantConfig("gptq", tuple(rules), (*_containing(qc.get("modules_to_not_convert"), where, "GPTQ"),
                                              *MOE_ROUTERS),
                       {"zero_offset": 1 if fmt == "gptq" else 0}, only=tuple(names))


def _refuse_online_transforms(transforms: Any, where: str) -> None:
    """compressed-tensors' transform_config: rotations folded into the weights (weight_input,
    weight_output) need nothing at run time; any other location applies to activations as the model
    runs (QuIP, SpinQuant online rotations), which nanovllm does not: refused by name."""
    if not transforms:
        return
    groups = transforms.get("config_groups") if isinstance(transforms, dict) else None
    for name, group in (groups or {}).items():
        for apply in (group or {}).get("apply") or ():
            location = (apply or {}).get("location")
            if location not in ("weight_input", "weight_output"):
                raise ValueError(f"{where}: compressed-tensors transform_config group {name!r} applies a "
                                 f"{group.get('type')!r} transform at {location!r}, to activations at run time: "
                                 "not supported (only transforms folded into the weights)")
