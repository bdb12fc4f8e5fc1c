"""`inference`: torch.inference_mode() around a function, entered only when not already on.

A batch-1 decode step calls execute -> forward, logits and sample, each of them also an entry point
of its own (the draft model, the tensor-parallel workers, tests). torch's decorator builds and
enters a new context at every call, several Python frames and C calls each: with the caches cold
after the model's forward (its weights stream through L2 and L3) three nested ones cost ~90 us a
step against ~30 for this check (Zen 3, benchmarks/RESULTS.md "The host's part of a batch-1 step").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def inference(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def in_inference_mode(*args: P.args, **kwargs: P.kwargs) -> R:
        # Inside inference mode grad mode is off unless a caller turned it back on: then enter it
        # again, as torch's decorator would, which turns it off.
        if torch.is_inference_mode_enabled() and not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return in_inference_mode
