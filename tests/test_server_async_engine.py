"""AsyncLLMEngine in process: deltas, cancellation, admission errors, the queue limit, a failing
step, a consumer that stops reading, and shutdown — each leaving no request or KV block behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams
from nanovllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestGroup,
    StreamStalledError,
)
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_tiny_model(tmp_path_factory.mktemp("async_engine"), "qwen3")
    return LLM(str(path), device="cpu", num_kvcache_blocks=64, max_model_len=256)


@pytest.fixture
def engine(llm: LLM) -> Iterator[LLMEngine]:
    yield llm.engine
    # Every test must leave the engine empty.
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_waiting"] == 0 and stats["num_running"] == 0


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def drain(outputs: AsyncIterator[RequestOutput]) -> tuple[str, list[RequestOutput]]:
    seen = [out async for out in outputs]
    return "".join(c.text for out in seen for c in out.outputs), seen


async def idle(async_engine: AsyncLLMEngine, timeout: float = 5.0) -> None:
    """Waits until the engine thread applied what was queued and holds nothing."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        s = async_engine.stats()
        if s["num_used_blocks"] == 0 and s["num_waiting"] == 0 and s["num_running"] == 0 \
                and not async_engine.engine.has_unfinished_requests():
            return
        assert loop.time() < deadline, f"engine not idle: {s}"
        await asyncio.sleep(0.01)


def run(engine: LLMEngine, body: object, **kw: object) -> None:
    async def main() -> None:
        ae = AsyncLLMEngine(engine, **kw)  # type: ignore[arg-type]
        ae.start()
        try:
            await body(ae)  # type: ignore[operator]
            await idle(ae)
        finally:
            await ae.shutdown()

    asyncio.run(main())


def test_deltas_add_up_to_the_offline_output(engine: LLMEngine, llm: LLM) -> None:
    prompts = ["Hello there", "A longer prompt about many things", "x"]
    expected = llm.generate(prompts, greedy(12), use_tqdm=False)

    async def body(ae: AsyncLLMEngine) -> None:
        results = await asyncio.gather(*(drain(ae.generate(p, greedy(12), f"r{i}")) for i, p in enumerate(prompts)))
        for (text, outs), exp in zip(results, expected):
            assert text == exp.outputs[0].text
            assert sum(len(c.token_ids) for o in outs for c in o.outputs) == len(exp.outputs[0].token_ids)
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert outs[-1].outputs[-1].finish_reason == exp.outputs[0].finish_reason

    run(engine, body)


def test_cancelled_consumer_aborts_its_request(engine: LLMEngine) -> None:
    async def body(ae: AsyncLLMEngine) -> None:
        got = 0

        async def consume() -> None:
            nonlocal got
            async for _ in ae.generate("tell me", greedy(200, ignore_eos=True), "long"):
                got += 1

        task = asyncio.create_task(consume())
        while got < 3:
            await asyncio.sleep(0.001)
        assert ae.stats()["num_used_blocks"] > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await idle(ae)
        # Closing the iterator early does the same.
        gen = ae.generate("tell me", greedy(200, ignore_eos=True), "closed")
        await gen.__anext__()
        await gen.aclose()  # type: ignore[attr-defined]

    run(engine, body)


def test_rejections_leave_nothing_behind(engine: LLMEngine) -> None:
    async def body(ae: AsyncLLMEngine) -> None:
        with pytest.raises(ValueError, match="max_model_len"):
            await drain(ae.generate(list(range(1, 300)), greedy(4), "too-long"))
        with pytest.raises(ValueError, match="stop_token_ids"):
            await drain(ae.generate("hi", greedy(4, stop_token_ids=[10**6]), "bad-stop"))
        # One bad request of a group rejects the group; the good one is aborted too.
        with pytest.raises(ValueError):
            await ae.add_requests([("ok", "hi", greedy(50)), ("bad", [10**6], greedy(4))])
        with pytest.raises(ValueError, match="unique"):
            await ae.add_requests([("same", "hi", greedy(4)), ("same", "hi", greedy(4))])
        text, _ = await drain(ae.generate("hi", greedy(4), "ok"))  # the id is free again
        assert text

    run(engine, body)


def test_queue_limit(engine: LLMEngine) -> None:
    async def body(ae: AsyncLLMEngine) -> None:
        # More prompts than the queue ever holds: no retry would help, so it is a bad request.
        with pytest.raises(ValueError, match="more than the 2"):
            await ae.add_requests([(f"q{i}", "hi", greedy(4)) for i in range(3)])
        # Two groups queued together (admitted between the same two steps, none scheduled yet):
        # the second finds two waiting.
        first, second = await asyncio.gather(ae.add_requests([(f"q{i}", "hi", greedy(4)) for i in range(2)]),
                                             ae.add_requests([("q2", "hi", greedy(4))]), return_exceptions=True)
        assert isinstance(second, QueueFullError)
        assert isinstance(first, RequestGroup)
        assert len([out async for out in first if out.finished]) == 2

    run(engine, body, max_queued_requests=2)


def test_failing_step_fails_requests_in_flight_and_engine_goes_on(engine: LLMEngine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def body(ae: AsyncLLMEngine) -> None:
        with pytest.raises(RequestFailedError, match="boom"):
            await drain(ae.generate("hi", greedy(50, ignore_eos=True), "victim"))
        text, _ = await drain(ae.generate("hi", greedy(5), "after"))
        assert text

    run(engine, body)


@pytest.mark.parametrize("limits,reason", [({"buffer_entries_per_request": 60}, "unread tokens and logprobs"),
                                          ({"stall_timeout": 0.3}, "no output taken for")],
                         ids=["buffer-bound", "stall-timeout"])
def test_a_consumer_that_stops_reading_is_aborted(engine: LLMEngine, limits: dict, reason: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine does not wait for consumers: one that stops taking outputs is aborted (its
    blocks freed) once more than the bound waits unread, or the oldest has waited too long."""
    step = engine.step

    def slow_step() -> list:
        time.sleep(0.005)  # 200 tokens take >= 1 s, past the stall timeout, however fast the engine
        return step()

    monkeypatch.setattr(engine, "step", slow_step)

    async def body(ae: AsyncLLMEngine) -> None:
        group = await ae.add_requests([("stalls", "hi", greedy(200, ignore_eos=True, logprobs=5))])
        first = await group.__anext__()
        assert not first.finished
        await idle(ae, timeout=30)  # nobody reads; the request still ends, long before 200 tokens
        with pytest.raises(StreamStalledError, match=reason):
            await group.__anext__()
        assert group.finished
        # A consumer that keeps reading is never aborted under the same limits.
        text, outs = await drain(ae.generate("hi", greedy(40, ignore_eos=True, logprobs=5), "reads"))
        assert sum(len(c.token_ids) for o in outs for c in o.outputs) == 40

    run(engine, body, **limits)


def test_shutdown_ends_requests_in_flight(engine: LLMEngine) -> None:
    async def main() -> None:
        ae = AsyncLLMEngine(engine)
        ae.start()
        gen = ae.generate("hi", greedy(200, ignore_eos=True), "in-flight")
        await gen.__anext__()
        await ae.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        assert not ae.is_running
        with pytest.raises(EngineDeadError):
            await ae.add_requests([("late", "hi", greedy(2))])

    asyncio.run(main())


def test_idle_engine_thread_sleeps(engine: LLMEngine) -> None:
    async def body(ae: AsyncLLMEngine) -> None:
        await drain(ae.generate("hi", greedy(3), "warm"))
        await asyncio.sleep(0.05)
        cpu0 = time.process_time()
        await asyncio.sleep(0.5)
        # The whole process (engine thread included) stays nearly idle: no busy polling.
        assert time.process_time() - cpu0 < 0.1

    run(engine, body)
