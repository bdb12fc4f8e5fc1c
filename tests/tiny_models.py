"""Tiny random-weight Hugging Face models for the model tests (built by nanovllm.builtin_model).

One spec per code path worth covering: Qwen3 (q/k norm, head_dim != hidden/heads), Qwen2 (qkv
bias, head_dim absent from config.json), Llama plain, Llama with llama3 rope scaling, Mistral,
Qwen3 with YaRN and Llama with linear rope scaling, and Llama with tied embeddings plus
attention/MLP biases. All are GQA (4 heads / 2 kv heads).
"""

from __future__ import annotations

from pathlib import Path

from nanovllm.builtin_model import TinyModelSpec, create_model_dir

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the test positions span the scaled, smoothed and unscaled frequency bands.
    "original_max_position_embeddings": 64,
}

TINY_SPECS: dict[str, TinyModelSpec] = {
    "qwen3": TinyModelSpec(arch="Qwen3ForCausalLM", head_dim=32, seed=1),
    "qwen2": TinyModelSpec(arch="Qwen2ForCausalLM", head_dim=None, seed=2),
    "llama": TinyModelSpec(arch="LlamaForCausalLM", head_dim=16, seed=3),
    "llama3_rope": TinyModelSpec(
        arch="LlamaForCausalLM", head_dim=16, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, seed=4
    ),
    # Mistral: Llama's layers, its own config class (a sliding window longer than the tests' contexts).
    "mistral": TinyModelSpec(arch="MistralForCausalLM", head_dim=16, seed=6, extra={"sliding_window": 4096}),
    # Long-context rope scaling: YaRN (Qwen3's model card for 128k) and linear interpolation, with a
    # short original length so that the tests' positions pass it.
    "qwen3_yarn": TinyModelSpec(arch="Qwen3ForCausalLM", head_dim=32, seed=7, max_position_embeddings=256,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64}),
    "llama_linear": TinyModelSpec(arch="LlamaForCausalLM", head_dim=16, seed=8,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama_tied": TinyModelSpec(
        arch="LlamaForCausalLM",
        head_dim=16,
        tie_word_embeddings=True,
        attention_bias=True,
        extra={"mlp_bias": True},
        seed=5,
    ),
}


def make_tiny_model(root: Path, name: str) -> Path:
    """Create the tiny model `name` (a key of TINY_SPECS) under `root / name`."""
    return create_model_dir(root / name, spec=TINY_SPECS[name])
