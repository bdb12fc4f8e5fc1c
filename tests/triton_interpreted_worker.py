"""Runs the Triton paged prefill kernel under Triton's CPU interpreter for the cases given as JSON
on stdin and prints, as JSON, each case's relative error against the torch reference and whether
the kernel wrote exactly the prefill rows. Started by tests/test_triton_prefill.py in a
process of its own, because TRITON_INTERPRET must be set before triton is first imported.
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

import torch  # noqa: E402
from kernel_cases import make_case, reference, relative_error  # noqa: E402

from nanovllm.attention.triton_prefill import prefill_attention  # noqa: E402


def run(case: dict) -> dict:
    dtype = getattr(torch, case["dtype"])
    nd = case["num_decode"]
    c = make_case(context_lens=case["context_lens"], q_lens=case["q_lens"], num_decode=nd, num_kv_heads=2,
                  group=case["group"], head_dim=case["head_dim"], block_size=case["block_size"], dtype=dtype,
                  seed=case["seed"])
    m = c.meta
    out = torch.full_like(c.query, float("nan"))  # poisoned: every prefill row must be written
    prefill_attention(c.query, c.k_cache, c.v_cache, out, m.cu_seqlens_q, m.context_lens, m.block_tables,
                      first_seq=nd, num_seqs=m.num_seqs - nd, max_seqlen_q=m.max_seqlen_q, scale=c.scale)
    first = int(m.cu_seqlens_q[nd])
    got = out[first:]
    return {
        "other_rows_untouched": bool(torch.isnan(out[:first]).all()),
        "all_written": not bool(torch.isnan(got).any()),
        "error": relative_error(got, reference(c)[first:]) if got.numel() and not torch.isnan(got).any() else None,
    }


if __name__ == "__main__":
    print(json.dumps([run(case) for case in json.load(sys.stdin)]))
