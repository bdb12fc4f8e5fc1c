"""Runs the Triton MoE grouped GEMM (nanovllm/layers/triton_moe.py) under Triton's CPU interpreter
for the cases (tests/moe_cases.py) given as JSON on stdin and prints, as JSON, each case's error
against the per-token reference and whether `align` grouped the assignments as it must. Started by
tests/test_triton_moe.py in a process of its own, because TRITON_INTERPRET must be set before
triton is first imported.
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

import torch  # noqa: E402
from moe_cases import Case, make_weights, per_token_reference, relative_error  # noqa: E402

from nanovllm.layers import moe_torch, triton_moe  # noqa: E402


def alignment_ok(ids: torch.Tensor, experts: int, block_m: int) -> bool:
    """Every assignment once, in blocks of block_m whose rows all chose the block's expert."""
    al = triton_moe.align(ids, experts, block_m)
    n, flat = ids.numel(), ids.reshape(-1)
    rows = al.sorted.view(-1, block_m)
    real = rows[rows < n]
    if sorted(real.tolist()) != list(range(n)):
        return False
    for block, expert in zip(rows, al.block_expert.tolist()):
        mine = block[block < n].long()
        if (expert < 0 and len(mine)) or (len(mine) and not (flat[mine] == expert).all()):
            return False
    return True


def run(case: dict) -> dict:
    c = Case(**case)
    x, logits, w13, w2 = make_weights(c, seed=c.experts * 100 + c.rows)
    ids, weights = moe_torch.route(logits, c.top_k, c.renormalize)
    got = triton_moe.fused_experts(x, ids, weights, w13, w2)
    return {"error": relative_error(got, per_token_reference(x, logits, w13, w2, c.top_k, c.renormalize)),
            "shape_ok": got.shape == x.shape and got.dtype == x.dtype,
            "aligned": all(alignment_ok(ids, c.experts, m) for m in (16, 64))}


if __name__ == "__main__":
    print(json.dumps([run(case) for case in json.load(sys.stdin)]))
