"""LLMEngine: requests in, outputs out, one `step()` at a time.

    plan = core.schedule()                      # C++: who runs, blocks, flat arrays
    tokens = runner.execute(plan, sampling)     # tensors, CoW copies, forward, sample
    finished = core.postprocess(tokens)         # C++: append, stop checks, free blocks
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm import _C
from nanovllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from nanovllm.engine.sampling_table import SamplingTable, SequenceIds
from nanovllm.executor.model_runner import ModelRunner
from nanovllm.model_config import load_model_config
from nanovllm.models.loader import find_weight_files, validate_weight_files
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


@dataclass
class _Request:
    request_id: str
    seq_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Every file is checked before any memory is reserved.
        model_config = load_model_config(config.model)
        validate_weight_files(find_weight_files(config.model))
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.model)
        self.device = config.resolve_device()
        torch.manual_seed(config.seed)
        self.max_model_len, budget = config.resolve_lengths(model_config.max_position_embeddings)
        self.runner = ModelRunner(config.model, config.dtype, self.device, config.block_size)
        num_blocks = self._num_kv_blocks(budget)
        self.runner.allocate_kv_cache(num_blocks)
        self.vocab_size = model_config.vocab_size
        eos = set(model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.core = _C.Scheduler(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            eos_token_ids=sorted(t for t in eos if 0 <= t < self.vocab_size),
            vocab_size=self.vocab_size,
        )
        self.sampling = SamplingTable(self.device)
        self._seq_ids = SequenceIds()
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._request_counter = 0

    def _num_kv_blocks(self, budget: int) -> int:
        c = self.config
        if c.num_kvcache_blocks is not None:
            return c.num_kvcache_blocks
        per_block = self.runner.kv_spec.bytes_per_block
        if self.device.type == "cuda" and c.kv_cache_memory_bytes is None:
            blocks = self.runner.profile_num_blocks(c.gpu_memory_utilization, budget)
        else:
            blocks = (c.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) // per_block
        if blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache (one block needs {per_block} bytes); "
                "raise gpu_memory_utilization or kv_cache_memory_bytes"
            )
        return int(blocks)

    # Requests -----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt_token_ids' or a string 'prompt'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def next_request_id(self) -> str:
        self._request_counter += 1
        return str(self._request_counter - 1)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        sid = self._seq_ids.acquire()
        try:
            self.core.add(sid, token_ids, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                          ignore_eos=params.ignore_eos, stop_token_ids=params.stop_token_ids)
        except ValueError:
            self._seq_ids.release(sid)
            raise
        self.sampling.set(sid, params)
        req = _Request(request_id, sid, text, token_ids, params, RequestMetrics(arrival_time or time.time()))
        self._requests[request_id] = req
        self._by_seq[sid] = req

    def abort_request(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        self.core.abort(req.seq_id)
        self._forget(req)

    def _forget(self, req: _Request) -> None:
        del self._requests[req.request_id]
        del self._by_seq[req.seq_id]
        self.sampling.clear(req.seq_id)
        self._seq_ids.release(req.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # The step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one forward pass; returns the outputs of the requests that finished in it."""
        plan = self.core.schedule()
        sids = plan.sampled_seq_ids
        try:
            tokens = self.runner.execute(plan, self.sampling.batch(sids))
        except BaseException:
            # The batch's KV state is unknown now: drop its requests, keep the engine consistent.
            for sid in plan.seq_ids.tolist():
                self.core.abort(sid)
                self._forget(self._by_seq[sid])
            self.core.postprocess(np.zeros(plan.num_samples, dtype=np.int32))
            raise
        sids = sids.tolist()
        finished = self.core.postprocess(tokens)
        now = time.time()
        for sid, tok in zip(sids, tokens.tolist()):
            req = self._by_seq.get(sid)
            if req is None:
                continue
            if not req.output_token_ids:
                req.metrics.first_token_time = now
            req.output_token_ids.append(tok)
        outputs = []
        for sid, reason, stop_token in finished:
            req = self._by_seq[sid]
            req.metrics.finished_time = now
            outputs.append(self._make_output(req, reason, stop_token))
            self._forget(req)
        return outputs

    def _make_output(self, req: _Request, reason: str, stop_reason: int | None) -> RequestOutput:
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        completion = CompletionOutput(0, text, list(req.output_token_ids), reason, stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], True, req.metrics)

    def stats(self) -> dict[str, int]:
        s = dict(self.core.stats())
        s["num_requests"] = len(self._requests)
        s["block_size"] = self.config.block_size
        s["max_model_len"] = self.max_model_len
        return s
