"""Shared pieces of the tensor-parallel tests: tiny models whose shapes exercise the sharding, and
checks that an engine left nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

from moe_models import make_moe_model

from nanovllm.builtin_model import TinyModelSpec, create_model_dir

# 4 query heads on 2 ranks each; what differs is how the KV heads and the vocabulary split.
TP_SPECS: dict[str, TinyModelSpec] = {
    # 2 KV heads: one per rank.
    "qwen3": TinyModelSpec(arch="Qwen3ForCausalLM", head_dim=32, seed=11),
    # A vocabulary that does not divide by 2: the last rank's embedding rows are padded.
    "qwen2_odd_vocab": TinyModelSpec(arch="Qwen2ForCausalLM", head_dim=None, vocab_size=511, seed=12),
    # One KV head for 2 ranks (replicated), tied embeddings, biases everywhere.
    "llama_mqa_tied": TinyModelSpec(arch="LlamaForCausalLM", head_dim=16, num_key_value_heads=1,
                                    tie_word_embeddings=True, attention_bias=True, extra={"mlp_bias": True}, seed=13),
}


def make_tp_model(root: Path, name: str) -> Path:
    """A TP_SPECS model, or a mixture of experts of tests/moe_models.py."""
    if name in TP_SPECS:
        return create_model_dir(root / name, spec=TP_SPECS[name])
    return make_moe_model(root, name)


def shm_segments() -> list[str]:
    """This process's step-ring names still in /dev/shm."""
    prefix = f"nanovllm-{os.getpid()}-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def alive(pid: int) -> bool:
    """Running (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    """Live child processes of `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out
