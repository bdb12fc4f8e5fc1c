"""Per-sequence sampling settings kept in arrays indexed by the core's sequence id, so a step
gathers its batch's settings with one numpy fancy-index per field instead of a Python loop."""

from __future__ import annotations

import numpy as np
import torch

from nanovllm.layers.sampler import GREEDY_EPS, SamplingBatch
from nanovllm.sampling_params import SamplingParams


class SequenceIds:
    """Small, recycled integer ids for the core's sequences (they index the tables below)."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0

    def acquire(self) -> int:
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def release(self, sid: int) -> None:
        self._free.append(sid)


class SamplingTable:
    def __init__(self, device: torch.device, capacity: int = 256) -> None:
        self.device = device
        self.temperature = np.ones(capacity, dtype=np.float32)
        self.top_k = np.zeros(capacity, dtype=np.int64)
        self.top_p = np.ones(capacity, dtype=np.float32)
        self.min_p = np.zeros(capacity, dtype=np.float32)
        # Rows needing logit processing (penalties, bias, min_tokens) and top-k logprobs (-1: none).
        self.needs_processing = np.zeros(capacity, dtype=bool)
        self.logprobs = np.full(capacity, -1, dtype=np.int64)
        self.generators: dict[int, torch.Generator] = {}

    def _grow(self, sid: int) -> None:
        size = len(self.temperature)
        if sid < size:
            return
        extra = max(sid + 1, 2 * size) - size
        self.temperature = np.concatenate([self.temperature, np.ones(extra, np.float32)])
        self.top_k = np.concatenate([self.top_k, np.zeros(extra, np.int64)])
        self.top_p = np.concatenate([self.top_p, np.ones(extra, np.float32)])
        self.min_p = np.concatenate([self.min_p, np.zeros(extra, np.float32)])
        self.needs_processing = np.concatenate([self.needs_processing, np.zeros(extra, bool)])
        self.logprobs = np.concatenate([self.logprobs, np.full(extra, -1, np.int64)])

    def set(self, sid: int, params: SamplingParams, generator: torch.Generator | None = None) -> None:
        """Records a sequence's settings; `generator` shares a sibling's seeded stream (n > 1)."""
        self._grow(sid)
        self.temperature[sid] = params.temperature
        self.top_k[sid] = max(params.top_k, 0)
        self.top_p[sid] = params.top_p
        self.min_p[sid] = params.min_p
        self.needs_processing[sid] = params.has_penalties or bool(params.logit_bias) or params.min_tokens > 0
        self.logprobs[sid] = -1 if params.logprobs is None else params.logprobs
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        if generator is not None:
            self.generators[sid] = generator
        else:
            self.generators.pop(sid, None)

    def clear(self, sid: int) -> None:
        self.generators.pop(sid, None)

    def batch(self, sids: np.ndarray) -> SamplingBatch:
        temps = self.temperature[sids]
        sampled = temps > GREEDY_EPS
        top_k, top_p, min_p = self.top_k[sids], self.top_p[sids], self.min_p[sids]
        generators = None
        if self.generators:
            generators = [self.generators.get(int(s)) for s in sids]
        dev = self.device
        return SamplingBatch(
            temperatures=torch.from_numpy(temps).to(dev, non_blocking=True),
            top_k=torch.from_numpy(top_k).to(dev, non_blocking=True),
            top_p=torch.from_numpy(top_p).to(dev, non_blocking=True),
            min_p=torch.from_numpy(min_p).to(dev, non_blocking=True),
            generators=generators,
            all_greedy=not sampled.any(),
            any_top_k=bool((sampled & (top_k > 0)).any()),
            any_top_p=bool((sampled & (top_p < 1.0)).any()),
            any_min_p=bool((sampled & (min_p > 0.0)).any()),
        )
