"""ModelRunner pieces that the GPU path relies on, run on the CPU: the memory-profiling forward
(the same code as on a GPU, without the memory readings) and the KV cache's release."""

from __future__ import annotations

from pathlib import Path

from tiny_models import make_tiny_model

from nanovllm.config import EngineConfig
from nanovllm.layers.attention import attention_layers
from nanovllm.worker.model_runner import ModelRunner


def test_profiling_forward_runs_at_the_full_budget_and_releases_its_cache(tmp_path: Path) -> None:
    runner = ModelRunner(EngineConfig(model=str(make_tiny_model(tmp_path, "qwen3")), dtype="float32", device="cpu",
                                      block_size=16, max_num_seqs=8, max_model_len=256).resolve())
    scratch = runner._dummy_forward(100)  # 100 tokens: 7 blocks of 16, the last one partly used
    assert scratch == 7 * runner.kv_spec.bytes_per_block
    assert runner.kv_cache is None
    assert all(layer.k_cache.numel() == 0 and layer.v_cache.numel() == 0 for layer in attention_layers(runner.model))
    # The runner takes a real cache afterwards.
    runner.allocate_kv_cache(4)
    assert runner.kv_cache is not None and runner.kv_cache.shape[2] == 4
    assert all(layer.k_cache.shape[0] == 4 for layer in attention_layers(runner.model))
    runner.release_kv_cache()
    assert runner.kv_cache is None
