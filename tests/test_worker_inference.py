"""worker/inference.py's decorator: torch.inference_mode() as torch's own decorator gives it, entered
only where it is not already on (the step's nested calls)."""

from __future__ import annotations

import pytest
import torch

from nanovllm.worker.inference import inference


def test_inference_mode_as_torch_gives_it_entered_only_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    entered = []
    mode = torch.inference_mode
    monkeypatch.setattr(torch, "inference_mode", lambda *a: entered.append(1) or mode(*a))
    seen = []

    @inference
    def inner() -> torch.Tensor:
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return torch.ones(1)

    @inference
    def outer() -> torch.Tensor:
        return inner() + inner()

    assert outer().is_inference() and len(entered) == 1  # once for the outer call, not for the nested ones
    with torch.no_grad():
        inner()
    with mode(), torch.enable_grad():  # grad turned back on inside: entered again, which turns it off
        inner()
    assert seen == [(False, True)] * 4 and len(entered) == 3
    assert inner.__name__ == "inner"
