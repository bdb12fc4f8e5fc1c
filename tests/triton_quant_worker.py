"""Runs the Triton dequantizing GEMM (nanovllm/layers/quantization/triton_gemm.py) under Triton's CPU
interpreter for the cases given as JSON on stdin and prints, as JSON, each case's largest error
relative to the largest output of `x @ dequantize(W).T`. Started by tests/test_quant_triton.py in
a process of its own, because TRITON_INTERPRET must be set before triton is first imported.
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

import torch  # noqa: E402
from quant_helpers import random_quantized  # noqa: E402

from nanovllm.layers.quantization.triton_gemm import TritonWeight, linear  # noqa: E402


def run(case: dict) -> float:
    w = random_quantized(case["n"], case["k"], case["bits"], case["group"], case["symmetric"], seed=case["seed"],
                         act_order=case["act_order"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    dtype = getattr(torch, case["dtype"])
    x = torch.randn(case["m"], case["k"], generator=g).to(dtype)
    bias = torch.randn(case["n"], generator=g).to(dtype) if case["bias"] else None
    y = linear(x, TritonWeight.from_weight(w, "cpu"), bias)
    expected = torch.nn.functional.linear(x.double(), w.dequantize(torch.float64),
                                          None if bias is None else bias.double())
    if y.dtype != dtype or y.shape != expected.shape:
        return float("inf")
    return float((y.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-9))


if __name__ == "__main__":
    print(json.dumps([run(case) for case in json.load(sys.stdin)]))
