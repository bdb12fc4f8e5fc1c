"""Write a random-weight model with Qwen3-0.6B's shapes (or a smaller Qwen3, or a Qwen3-MoE) for the benchmarks.

No download: the weights are random (transformers' init, from a fixed seed), stored in bf16, and the
tokenizer is the built-in model's small byte-level BPE (4096 tokens) while the model's vocabulary
keeps Qwen3's 151936 rows, so the embedding, the LM head and the sampler do the real amount of
work. Token ids without a tokenizer entry decode to nothing, which the throughput benchmark (random
prompt ids, ignore_eos, counted in tokens) does not mind.

Qwen3-0.6B: hidden 1024, 28 layers, 16 query / 8 KV heads of head_dim 128, intermediate 3072,
vocab 151936, tied embeddings, rope theta 1e6, max_position_embeddings 40960.

Usage: python benchmarks/make_bench_model.py OUT_DIR [--shape qwen3-0.6b|qwen3-cpu|qwen3-moe-cpu|tiny]
The directory is reused when it already holds a complete model of the same shape.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open

from nanovllm.builtin_model import SPEC_FILE, TinyModelSpec, create_model_dir

SHAPES = {
    "qwen3-0.6b": TinyModelSpec(
        arch="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        seed=606,
    ),
    # The CPU comparison against vLLM (benchmarks/compare_vllm.py, issue 10): Qwen3's structure at a
    # size a 2-core CPU decodes at a few hundred tokens/s.
    "qwen3-cpu": TinyModelSpec(
        arch="Qwen3ForCausalLM", vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, seed=606,
    ),
    # Qwen3-MoE's structure (Qwen3-30B-A3B: 128 experts, top-8, moe_intermediate 768, norm_topk_prob) at
    # the qwen3-cpu size (issue 23): 32 experts of 512, top-4, every layer sparse; ~460M parameters of
    # which ~88M are read per token (4 of 32 experts).
    "qwen3-moe-cpu": TinyModelSpec(
        arch="Qwen3MoeForCausalLM", vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, seed=606,
        extra=dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True),
    ),
    # Same structure, a few MB: for --dry-run checks of the scripts on a CPU.
    "tiny": TinyModelSpec(
        arch="Qwen3ForCausalLM", vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        rope_theta=1000000.0, tie_word_embeddings=True, seed=606,
    ),
}
TOKENIZER_VOCAB = 4096


def make(out: Path, shape: str) -> Path:
    spec = SHAPES[shape]
    marker = out / SPEC_FILE
    if marker.is_file() and json.loads(marker.read_text()) == asdict(spec):
        print(f"reusing {out}")
        return out
    create_model_dir(out, spec=spec, dtype=torch.bfloat16, tokenizer_vocab=TOKENIZER_VOCAB)
    params = 0
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            params += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    print(f"wrote {out}: {shape}, {params / 1e6:.0f}M parameters (bf16), tokenizer {TOKENIZER_VOCAB} tokens, "
          f"model vocab {spec.vocab_size}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    args = p.parse_args(argv)
    make(args.out, args.shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())

