"""The tensor-parallel model path with a one-rank group, and how ranks agree on CUDA graphs.

One rank runs every sharded layer, all-reduce and gather the way N ranks do (gloo on CPU, NCCL on
a GPU, where the all-reduces are captured inside the decode graphs), so one GPU checks the whole
model side of tensor parallelism against transformers. The graph agreement (capture_buckets) runs
over a real two-rank gloo group with a capture failure injected on one rank.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_greedy_matches, hf_greedy, random_prompts
from tiny_models import make_tiny_model

from nanovllm import LLM
from nanovllm.distributed.parallel_state import TPGroup, free_port
from nanovllm.engine import llm_engine
from nanovllm.executor import Executor
from nanovllm.worker.cuda_graph import CaptureAbandoned, capture_buckets
from nanovllm.worker.model_runner import ModelRunner

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_group_runs_the_tensor_parallel_model_path(device: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model(tmp_path, "qwen3")
    dev = torch.device(device)
    group = TPGroup.connect(0, 1, "127.0.0.1", free_port(), "nccl" if device == "cuda" else "gloo", dev)
    built: list[ModelRunner] = []

    class OneRankExecutor(Executor):
        """The one-device executor, its runner given the one-rank group."""

        def __init__(self, config, eos_token_ids) -> None:  # noqa: ANN001  (make_executor's signature)
            self.config = config
            self.runner = ModelRunner(config, tp=group, eos_token_ids=eos_token_ids)
            built.append(self.runner)

    monkeypatch.setattr(llm_engine, "make_executor", OneRankExecutor)
    try:
        llm = LLM(str(path), device=device, dtype="float32", block_size=16, num_kvcache_blocks=64, max_model_len=512,
                  max_num_seqs=8, max_num_batched_tokens=48)
        runner = built[0]
        assert runner.tp is group and group.world_size == 1
        if device == "cuda":
            assert group.backend == "nccl" and runner.graphs is not None  # all-reduces captured
        oracle = hf_greedy
        if device == "cuda":
            from test_cuda_engine import hf_greedy_cuda as oracle  # noqa: N813
        assert_greedy_matches(llm, path, random_prompts([1, 9, 33, 70], 512, seed=3), 20, oracle)
    finally:
        group.close()


SCENARIOS = [None, 0, 1]  # which rank's capture of batch 4 fails


def _agree_worker(rank: int, port: int, out: mp.Queue) -> None:
    """Runs capture_buckets once per scenario over one two-rank gloo group."""
    group = TPGroup.connect(rank, 2, "127.0.0.1", port, "gloo", torch.device("cpu"))
    for fail_rank in SCENARIOS:
        calls = []

        def agree(captured: bool) -> bool:
            calls.append(captured)
            return group.all_reduce_min(int(captured)) == 1

        def capture_one(bs: int) -> object:
            if rank == fail_rank and bs == 4:
                raise RuntimeError(f"capture of batch {bs} failed")
            return f"graph-{bs}"

        try:
            result: object = sorted(capture_buckets([8, 4, 2, 1], capture_one, agree))
        except (RuntimeError, CaptureAbandoned) as e:
            result = f"{type(e).__name__}: {e}"
        # Both ranks made the same number of agreement calls: the next collective still pairs up.
        after = group.all_reduce_min(rank + 10)
        out.put((fail_rank, rank, result, len(calls), after))
    group.close()


def test_ranks_agree_to_decode_eagerly_when_one_capture_fails() -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_agree_worker, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in range(2 * len(SCENARIOS))]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert sorted((f is None, f or 0, r) for f, r, *_ in results) == sorted(
        (f is None, f or 0, r) for f in SCENARIOS for r in (0, 1))
    for fail_rank, rank, res, n, after in results:
        assert after == 10  # the MIN of 10 and 11 on both ranks: nobody hangs, nobody is a call behind
        if fail_rank is None:
            assert res == [1, 2, 4, 8] and n == 4
        else:
            assert n == 2  # batch 8, then the failing batch 4
            if rank == fail_rank:
                assert res == "RuntimeError: capture of batch 4 failed"
            else:
                assert res.startswith("CaptureAbandoned: another tensor-parallel rank failed")
