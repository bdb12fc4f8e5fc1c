"""Small helpers for driving `nanovllm._C.Scheduler` in tests."""

from nanovllm import _C


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    enable_prefix_caching: bool = True,
    eos_token_ids: tuple[int, ...] = (),
    vocab_size: int = 0,
) -> _C.Scheduler:
    return _C.Scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        eos_token_ids=eos_token_ids,
        vocab_size=vocab_size,
    )


def step(sched: _C.Scheduler, token: int = 7) -> tuple[_C.StepPlan, list[tuple[int, str, int | None]]]:
    """One schedule + postprocess, every sample getting `token`."""
    plan = sched.schedule()
    finished = sched.postprocess([token] * plan.num_samples)
    return plan, finished
