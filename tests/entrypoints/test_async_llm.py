"""AsyncLLM: one engine thread serving many asyncio callers, aborts on cancel, errors surfaced."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from tests.tiny import tiny_loaded_model

pytestmark = pytest.mark.timeout(120)

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [30] * 20, [40, 41]]


def make_engine(**kwargs):
    kwargs.setdefault("num_blocks", 64)
    kwargs.setdefault("block_size", 4)
    return LLM(loaded_model=tiny_loaded_model(), **kwargs).engine


@pytest.fixture
def async_llm():
    llm = AsyncLLM(make_engine())
    yield llm
    llm.shutdown()
    assert not llm._thread.is_alive()


async def collect(llm: AsyncLLM, prompt, params, request_id=None):
    outs = [out async for out in llm.generate(prompt, params, request_id)]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return outs


async def wait_until_settled(llm: AsyncLLM, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = llm.stats()
        if stats["blocks_in_use"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine did not settle: {llm.stats()}")


def test_concurrent_requests_match_offline_generation(async_llm):
    params = SamplingParams(max_tokens=6, **GREEDY)
    expected = LLM(loaded_model=tiny_loaded_model(), num_blocks=64, block_size=4).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)

    async def main():
        results = await asyncio.gather(
            *(collect(async_llm, {"prompt_token_ids": p}, params) for p in PROMPTS))
        await wait_until_settled(async_llm)
        return results

    results = asyncio.run(main())
    for outs, want in zip(results, expected, strict=True):
        final = outs[-1].outputs[0]
        assert final.token_ids == want.outputs[0].token_ids
        # the streamed deltas assemble to the final output
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == final.text


def test_loop_stays_responsive_while_engine_steps(async_llm):
    async def main():
        ticks = 0
        task = asyncio.ensure_future(collect(async_llm, [5, 6, 7], SamplingParams(max_tokens=40, **GREEDY)))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0)
        await task
        return ticks

    assert asyncio.run(main()) > 10


def test_cancelled_consumer_aborts_request_and_frees_blocks(async_llm):
    params = SamplingParams(max_tokens=400, **GREEDY)

    async def consume(first_output: asyncio.Event):
        async for _ in async_llm.generate([5, 6, 7, 8, 9], params, "victim"):
            first_output.set()

    async def main():
        first_output = asyncio.Event()
        task = asyncio.ensure_future(consume(first_output))
        await asyncio.wait_for(first_output.wait(), 20)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wait_until_settled(async_llm)

    stats = asyncio.run(main())
    assert stats["generation_tokens"] < 400  # aborted long before max_tokens


def test_breaking_out_of_the_iteration_aborts(async_llm):
    async def main():
        gen = async_llm.generate([5, 6, 7], SamplingParams(max_tokens=400, **GREEDY), "early-exit")
        async for _ in gen:
            break
        await gen.aclose()
        return await wait_until_settled(async_llm)

    assert asyncio.run(main())["generation_tokens"] < 400


def test_abort_by_id_ends_the_stream_with_abort(async_llm):
    async def main():
        finish = None
        async for out in async_llm.generate([5, 6, 7], SamplingParams(max_tokens=400, **GREEDY), "to-abort"):
            async_llm.abort("to-abort")
            finish = out.outputs[0].finish_reason
        await wait_until_settled(async_llm)
        return finish

    assert asyncio.run(main()) == "abort"


def test_bad_prompt_raises_before_anything_is_queued(async_llm):
    async def main():
        for prompt in ([], [10_000], [1] * 10_000, 3.5):
            with pytest.raises(ValueError):
                await collect(async_llm, prompt, SamplingParams(max_tokens=2))
        # still serving
        return await collect(async_llm, [5, 6], SamplingParams(max_tokens=2, **GREEDY))

    outs = asyncio.run(main())
    assert len(outs[-1].outputs[0].token_ids) == 2
    assert async_llm.stats()["prompt_tokens_computed"] == 2  # the bad prompts never reached the engine


def test_reused_request_id_gets_a_unique_suffix(async_llm):
    params = SamplingParams(max_tokens=5, **GREEDY)

    async def main():
        return await asyncio.gather(*(collect(async_llm, [5, 6, 7], params, "same") for _ in range(3)))

    results = asyncio.run(main())
    ids = {outs[-1].request_id for outs in results}
    assert len(ids) == 3 and "same" in ids
    assert len({tuple(outs[-1].outputs[0].token_ids) for outs in results}) == 1


def test_engine_exception_fails_requests_and_marks_engine_dead():
    engine = make_engine()
    llm = AsyncLLM(engine)

    def broken_step():
        raise RuntimeError("simulated kernel failure")

    engine.step = broken_step  # type: ignore[method-assign]

    async def main():
        with pytest.raises(RequestFailedError, match="simulated kernel failure"):
            await collect(llm, [5, 6, 7], SamplingParams(max_tokens=3))
        with pytest.raises(EngineDeadError, match="crashed"):
            await collect(llm, [5, 6, 7], SamplingParams(max_tokens=3))

    try:
        asyncio.run(main())
        assert not llm.is_alive and "simulated kernel failure" in (llm.dead_reason or "")
    finally:
        llm.shutdown()


def test_shutdown_joins_thread_and_refuses_new_requests():
    llm = AsyncLLM(make_engine())
    before = threading.active_count()
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert not llm._thread.is_alive()
    assert threading.active_count() == before - 1

    async def main():
        with pytest.raises(EngineDeadError):
            await collect(llm, [5, 6], SamplingParams(max_tokens=2))

    asyncio.run(main())


def test_idle_engine_thread_blocks_instead_of_spinning(async_llm):
    async def main():
        await collect(async_llm, [5, 6], SamplingParams(max_tokens=2, **GREEDY))
        await wait_until_settled(async_llm)

    asyncio.run(main())
    published = async_llm.stats()["timestamp"]
    time.sleep(0.3)
    assert async_llm.stats()["timestamp"] == published  # no steps (no stats published) while idle


def test_every_step_binds_the_runner_s_device_on_the_engine_thread(monkeypatch) -> None:
    """CUDA's current device is per thread and eager Triton kernels launch on it: the engine
    thread, not the one that built the worker, must make the runner's device current."""
    from kvrelay.worker import model_runner

    bound: list[tuple[str, object]] = []
    monkeypatch.setattr(model_runner, "bind_device",
                        lambda device: bound.append((threading.current_thread().name, device)))
    llm = AsyncLLM(make_engine())
    try:
        asyncio.run(collect(llm, {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=3, **GREEDY)))
    finally:
        llm.shutdown()
    device = llm.engine.runner.device
    assert len(bound) >= 3 and set(bound) == {("kvrelay-engine", device)}
