"""The quantized checkpoint formats (nanovllm/layers/quantization): each unpacked and dequantized
against a reference written here from the format's definition, element by element, and
compressed-tensors also against its own library (its packer and its decompressor, when it
installs). Shape errors name the tensor; schemes nanovllm does not run are refused by name.

AutoAWQ and AutoGPTQ/GPTQModel do not install here (CUDA builds; autoawq's import pulls in
accelerate and datasets), so AWQ and GPTQ are checked against the references below only."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import awq_tensors, gptq_tensors, random_quantized

from nanovllm.layers.quantization import awq, compressed_tensors, gptq
from nanovllm.layers.quantization.config import UNQUANTIZED_MODULES, QuantConfig, WeightScheme, resolve_quant_config
from nanovllm.layers.quantization.packing import pack_int32, unpack_int32
from nanovllm.layers.quantization.weights import QuantizedWeight, concat_rows, quantize_rtn, unpacked

# --- references, one value at a time ------------------------------------------------------------


def nibble(word: int, i: int, bits: int) -> int:
    return (word >> (i * bits)) & ((1 << bits) - 1)


def ref_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """AWQ GEMM: word j of a row holds columns 8j + [0, 2, 4, 6, 1, 3, 5, 7] in its nibbles 0..7."""
    k, words = qweight.shape
    out = torch.empty(k, words * 8, dtype=torch.float64)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    for i in range(k):
        for j in range(words):
            for pos, col in enumerate(order):
                q = nibble(int(qweight[i, j]), pos, 4)
                z = nibble(int(qzeros[i // group, j]), pos, 4)
                out[i, 8 * j + col] = (q - z) * float(scales[i // group, 8 * j + col])
    return out.t()  # [out, in]


def ref_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
             zero_offset: int) -> torch.Tensor:
    """GPTQ: qweight packs input rows, qzeros output columns, sequentially; g_idx maps rows to groups."""
    per = 32 // bits
    k, n = g_idx.numel(), scales.shape[1]
    out = torch.empty(k, n, dtype=torch.float64)
    for i in range(k):
        g = int(g_idx[i])
        for o in range(n):
            q = nibble(int(qweight[i // per, o]), i % per, bits)
            z = nibble(int(qzeros[g, o // per]), o % per, bits) + zero_offset
            out[i, o] = (q - z) * float(scales[g, o])
    return out.t()


def ref_compressed(packed: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, bits: int, k: int,
                   g_idx: torch.Tensor | None, group: int) -> torch.Tensor:
    """pack-quantized: values + 2^(b-1) packed along the input dim, zero points the same along the output dim."""
    per, off = 32 // bits, 1 << (bits - 1)
    n = packed.shape[0]
    out = torch.empty(n, k, dtype=torch.float64)
    for o in range(n):
        for i in range(k):
            g = i // group if g_idx is None else int(g_idx[i])
            q = nibble(int(packed[o, i // per]), i % per, bits) - off
            z = 0 if zp is None else nibble(int(zp[o // per, g]), o % per, bits) - off
            out[o, i] = (q - z) * float(scale[o, g])
    return out


def dequant64(w: QuantizedWeight) -> torch.Tensor:
    return w.dequantize(torch.float64)


# --- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_matches_reference(group: int) -> None:
    w = random_quantized(24, 256, 4, group, symmetric=False, seed=group)
    w = QuantizedWeight(w.qweight, w.scales.half().float(), w.zeros.clamp(-8, 7), 4, group)  # type: ignore[union-attr]
    t = awq_tensors(w)
    got = awq.unpack(t, 4, group, 24, 256, "m.q_proj")
    ref = ref_awq(t["qweight"], t["qzeros"], t["scales"], group)
    assert torch.equal(dequant64(got), ref)
    assert torch.equal(got.qweight, w.qweight) and torch.equal(got.zeros, w.zeros)  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("zero_offset", [1, 0])  # checkpoint_format gptq (v1), gptq_v2
def test_gptq_matches_reference(bits: int, symmetric: bool, desc_act: bool, zero_offset: int) -> None:
    k, n, group = 192, 40, 64
    w = random_quantized(n, k, bits, group, symmetric, seed=bits + 2 * desc_act)
    if not symmetric:  # GPTQ stores zero points in [0, 2^bits) (minus the v1 offset)
        lo = -(1 << (bits - 1)) + zero_offset
        w = QuantizedWeight(w.qweight, w.scales.half().float(), w.zeros.clamp(lo, min(127, lo + (1 << bits) - 1)),  # type: ignore[union-attr]
                            bits, group)
    else:
        w = QuantizedWeight(w.qweight, w.scales.half().float(), None, bits, group)
    g = torch.Generator().manual_seed(5)
    # desc_act: rows in activation order, g_idx = (position in that order) // group, as GPTQ writes it
    order = torch.randperm(k, generator=g) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    stored = QuantizedWeight(w.qweight[:, torch.argsort(order)].contiguous() if desc_act else w.qweight,
                             w.scales, w.zeros, bits, group)
    t = gptq_tensors(stored, g_idx, zero_offset)
    got = gptq.unpack(t, bits, group, symmetric, zero_offset, n, k, "m.up_proj")
    ref = ref_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, bits, zero_offset)
    assert torch.equal(dequant64(got), ref)
    assert (got.perm is not None) == desc_act
    assert (got.zeros is None) == symmetric


def test_a_group_wider_than_the_layer_is_one_group() -> None:
    """The formats store ceil(in / group) groups: a group of 128 over a layer of 64 input columns is
    one group of all of them (AWQ, GPTQ, compressed-tensors)."""
    k, n = 64, 16
    w = random_quantized(n, k, 4, k, symmetric=False, seed=9)
    w = QuantizedWeight(w.qweight, w.scales.half().float(), w.zeros.clamp(-7, 7), 4, k)  # type: ignore[union-attr]
    wide = WeightScheme(4, 128, False)
    t = awq_tensors(w)
    got = QuantConfig("awq", ((("Linear",), wide),)).unpack(t, wide, n, k, "m.q_proj")
    assert got.group_size == k and torch.equal(dequant64(got), ref_awq(t["qweight"], t["qzeros"], t["scales"], k))
    g_idx = torch.arange(k) // 128
    t = gptq_tensors(w, g_idx, 1)
    got = QuantConfig("gptq", ((("Linear",), wide),), extra={"zero_offset": 1}).unpack(t, wide, n, k, "m.q_proj")
    assert torch.equal(dequant64(got), ref_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, 4, 1))
    got = QuantConfig("compressed-tensors", ((("Linear",), wide),)).unpack(compressed_tensors.pack(w, torch.float16),
                                                                           wide, n, k, "m.q_proj")
    assert torch.equal(got.dequantize(torch.float64), w.dequantize(torch.float64))


def test_fused_shards_with_and_without_zero_points() -> None:
    """GPTQ's sym=true keeps a shard's zero points only where they leave the midpoint: the fused
    layer (q/k/v, gate/up) gives the shards without them explicit zeros, the same weights."""
    a = random_quantized(8, 64, 4, 32, symmetric=True, seed=1)
    b = random_quantized(12, 64, 4, 32, symmetric=False, seed=2)
    for parts in ([a, b], [b, a], [a, a]):
        fused = concat_rows(parts)
        assert (fused.zeros is None) == all(p.zeros is None for p in parts)
        assert torch.equal(fused.dequantize(torch.float64), torch.cat([p.dequantize(torch.float64) for p in parts]))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [None, 32, 128])
def test_compressed_tensors_matches_reference(bits: int, symmetric: bool, group: int | None) -> None:
    weight = torch.randn(40, 256, generator=torch.Generator().manual_seed(bits)).to(torch.bfloat16)
    w = quantize_rtn(weight, bits, group, symmetric)
    t = compressed_tensors.pack(w, torch.bfloat16)
    assert set(t) == set(compressed_tensors.tensor_names(symmetric, False))
    got = compressed_tensors.unpack(t, bits, group, symmetric, 40, 256, "m.o_proj")
    ref = ref_compressed(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), bits, 256, None,
                         group or 256)
    assert torch.equal(dequant64(got), ref)
    assert torch.equal(got.qweight, w.qweight)
    # Round to nearest is within half a step of the weight (a little more at the clamped end of the
    # symmetric range, where the scale was rounded to bf16: 7.5 steps become up to 7.53); with a
    # zero point, rounding it moves the grid by up to half a step more.
    step = w.scales.repeat_interleave(w.group_size, dim=1)
    assert ((got.dequantize() - weight.float()).abs() <= (0.55 if symmetric else 1.1) * step).all()


def test_compressed_tensors_activation_order() -> None:
    """actorder "group": weight_g_idx assigns columns to groups; the weight keeps the stored order."""
    w = random_quantized(16, 128, 4, 32, symmetric=False, seed=9)
    w = QuantizedWeight(w.qweight, w.scales, w.zeros.clamp(-8, 7), 4, 32)  # type: ignore[union-attr]
    g_idx = torch.randperm(128, generator=torch.Generator().manual_seed(1)) // 32
    t = compressed_tensors.pack(w, torch.float32)
    t["weight_g_idx"] = g_idx.to(torch.int32)
    # Scales follow the groups of g_idx: w's group j is g_idx's group j.
    got = compressed_tensors.unpack(t, 4, 32, False, 16, 128, "m.k_proj")
    assert got.perm is not None
    assert torch.equal(dequant64(got), ref_compressed(t["weight_packed"], t["weight_scale"], t["weight_zero_point"],
                                                      4, 128, g_idx, 32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [None, 64])
def test_compressed_tensors_library_reads_what_we_write(bits: int, symmetric: bool, group: int | None) -> None:
    """The library's packer gives the same words as ours, and its decompressor the same weights as
    our unpacking (both rounded to the checkpoint's bf16, as it computes in the scale's dtype)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor, pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w = quantize_rtn(weight, bits, group, symmetric)
    ours = compressed_tensors.pack(w, torch.bfloat16)
    assert torch.equal(ours["weight_packed"], pack_to_int32(w.qweight, bits))
    if not symmetric:
        assert torch.equal(ours["weight_zero_point"], pack_to_int32(w.zeros, bits, packed_dim=0))
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group" if group else "channel",
                            group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    theirs = PackedQuantizationCompressor.decompress(dict(ours), scheme)["weight"]
    got = compressed_tensors.unpack(ours, bits, group, symmetric, 48, 256, "m.q_proj")
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(got.dequantize(torch.bfloat16), theirs)


def test_packing_round_trips() -> None:
    v = torch.randint(0, 16, (5, 19), generator=torch.Generator().manual_seed(0))
    for dim in (0, 1):
        p = pack_int32(v, 4, dim)
        assert torch.equal(unpack_int32(p, 4, dim, v.shape[dim]), v.to(torch.int32))
    assert pack_int32(torch.full((1, 8), 15), 4, 1).item() == -1  # all 32 bits set, as int32


def test_shape_errors_name_the_tensor() -> None:
    w = random_quantized(16, 128, 4, 32, symmetric=False, seed=1)
    w = QuantizedWeight(w.qweight, w.scales, w.zeros.clamp(-8, 7), 4, 32)  # type: ignore[union-attr]
    t = compressed_tensors.pack(w, torch.float32)
    with pytest.raises(ValueError, match=r"m\.v_proj\.weight_scale has shape \(16, 4\), expected \[16, 2\]"):
        compressed_tensors.unpack(t, 4, 64, False, 16, 128, "m.v_proj")
    with pytest.raises(ValueError, match=r"m\.v_proj\.weight_shape is \[16, 128\]"):
        compressed_tensors.unpack(t, 4, 32, False, 32, 128, "m.v_proj")
    bad = dict(t, weight_packed=t["weight_packed"][:, :-1])
    with pytest.raises(ValueError, match=r"m\.v_proj\.weight_packed is torch.int32 \(16, 15\)"):
        compressed_tensors.unpack(bad, 4, 32, False, 16, 128, "m.v_proj")
    bad = dict(t, weight_zero_point=torch.zeros(16, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight_zero_point .*packed along the output"):
        compressed_tensors.unpack(bad, 4, 32, False, 16, 128, "m.v_proj")
    a = awq_tensors(w)
    with pytest.raises(ValueError, match=r"m\.gate_proj\.qzeros"):
        awq.unpack(dict(a, qzeros=a["qzeros"][:2]), 4, 32, 16, 128, "m.gate_proj")
    g = gptq_tensors(QuantizedWeight(w.qweight, w.scales, None, 4, 32), torch.arange(128) // 32, 1)
    with pytest.raises(ValueError, match=r"m\.down_proj\.g_idx"):
        gptq.unpack(dict(g, g_idx=g["g_idx"][:-1]), 4, 32, True, 1, 16, 128, "m.down_proj")
    with pytest.raises(ValueError, match="does not split"):  # a group of 33 columns
        gptq.unpack(dict(g, g_idx=torch.tensor([0] * 33 + [1] * 31 + [2] * 32 + [3] * 32)), 4, 32, True, 1, 16, 128,
                    "m.down_proj")
    # What the formats hand QuantizedWeight's own checks fails naming the module too.
    with pytest.raises(ValueError, match=r"^m\.o_proj: quantized values outside the 4-bit range"):
        unpacked("m.o_proj", torch.full((2, 64), 9, dtype=torch.int8), torch.ones(2, 2), None, 4, 32)


def _ct_config(group: dict | None = None, top: dict | None = None, **weights: object) -> dict:
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, **weights}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                                                  **(group or {})}},
                                    "ignore": ["lm_head", "re:.*layers\\.1\\..*"], **(top or {})}}


def test_configs_and_unsupported_schemes() -> None:
    cfg = resolve_quant_config(_ct_config(), None, "c.json")
    assert cfg is not None and cfg.method == "compressed-tensors"
    assert cfg.scheme_for("model.layers.0.mlp.up_proj") == WeightScheme(4, 128, True)
    assert cfg.scheme_for("model.layers.1.mlp.up_proj") is None  # ignored by regex
    for size, scheme in ((32, WeightScheme(4, 32, True)), (-1, WeightScheme(4, None, True))):
        inferred = resolve_quant_config(_ct_config(strategy=None, group_size=size), None, "c.json")
        assert inferred is not None  # no strategy: compressed-tensors infers it from the group size
        assert inferred.scheme_for("model.layers.0.mlp.up_proj") == scheme, size
    assert resolve_quant_config({}, None, "c.json") is None
    rtn = resolve_quant_config({}, "int4", "c.json")
    assert rtn == QuantConfig("rtn", ((("Linear",), WeightScheme(4, 128, False)),), UNQUANTIZED_MODULES)
    assert rtn.scheme_for("model.layers.2.mlp.down_proj") == WeightScheme(4, 128, False)
    for router in ("model.layers.2.mlp.gate", "model.layers.0.block_sparse_moe.gate"):
        assert rtn.scheme_for(router) is None  # the routers of MoE layers stay unquantized
    awq_cfg = resolve_quant_config({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64,
                                                            "version": "gemm", "zero_point": True}}, None, "c.json")
    assert awq_cfg is not None and awq_cfg.scheme_for("model.layers.3.self_attn.o_proj") == WeightScheme(4, 64, False)
    gptq_cfg = resolve_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1,
                                                             "desc_act": True, "sym": True}}, None, "c.json")
    assert gptq_cfg is not None and gptq_cfg.scheme_for("x.q_proj") == WeightScheme(8, None, True, True)
    refused = {
        "W8A8": _ct_config({"input_activations": {"num_bits": 8}}, num_bits=8),
        "float-quantized": _ct_config(top={"format": "float-quantized"}),
        "tensor": _ct_config(strategy="tensor"),
        "3-bit": _ct_config(num_bits=3),
        "lm_head": _ct_config(top={"ignore": []}),
        "gemv": {"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}},
        "marlin": {"quantization_config": {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}},
        "marlin flag": {"quantization_config": {"quant_method": "gptq", "bits": 4, "is_marlin_format": True}},
        "fp8": {"quantization_config": {"quant_method": "fp8"}},
    }
    for name, raw in refused.items():
        with pytest.raises(ValueError, match="not supported") as e:
            resolve_quant_config(raw, None, "c.json")
        assert "c.json" in str(e.value), name
    malformed = {  # each a ValueError naming the field, not a TypeError from int()
        "group_size": _ct_config(group_size=None),
        "num_bits": _ct_config(num_bits="four"),
        "must be an object": {"quantization_config": {"quant_method": "compressed-tensors",
                                                      "config_groups": {"group_0": "w4a16"}}},
        "config_groups must be": {"quantization_config": {"quant_method": "compressed-tensors",
                                                          "config_groups": ["group_0"]}},
    }
    for field, raw in malformed.items():
        with pytest.raises(ValueError, match=f"c.json: .*{field}"):
            resolve_quant_config(raw, None, "c.json")
    integral = resolve_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 4.0, "group_size": 64.0}},
                                    None, "c.json")  # integral floats read as integers, as model_config's
    assert integral is not None and integral.scheme_for("x.q_proj") == WeightScheme(4, 64, True)
    for method in ("awq", "gptq"):
        with pytest.raises(ValueError, match=f"c.json: {method.upper()}: group_size must be an integer"):
            resolve_quant_config({"quantization_config": {"quant_method": method, "bits": 4, "group_size": "128"}},
                                 None, "c.json")
        with pytest.raises(ValueError, match=f"c.json: {method.upper()}: bits must be an integer"):
            resolve_quant_config({"quantization_config": {"quant_method": method, "bits": None}}, None, "c.json")
    with pytest.raises(ValueError, match="int8"):
        resolve_quant_config({}, "int3", "c.json")
    with pytest.raises(ValueError, match="quantized with 'compressed-tensors'"):
        resolve_quant_config(_ct_config(), "int8", "c.json")
    with pytest.raises(ValueError, match="no quantization_config"):
        resolve_quant_config({}, "awq", "c.json")
