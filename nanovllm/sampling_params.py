"""Sampling parameters, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, requirement: str) -> None:
            raise ValueError(f"{name} must be {requirement}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        if self.n > 1:
            raise ValueError(f"n={self.n}: parallel sampling (n > 1) is not supported yet; use n=1")
        if not is_number(self.temperature) or not 0.0 <= self.temperature < float("inf"):
            fail("temperature", "a finite number >= 0")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "-1 (off), 0 (off) or a positive integer")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "None or an integer")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", "an integer >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", "an integer in [0, max_tokens]")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "a bool")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
