"""AsyncLLMEngine: streaming, cancellation frees blocks, errors reach the caller, the
event loop stays responsive, and the decode-role hooks work through the async API."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.ops import RuntimeSettings
from tests.support import async_wait_until

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def async_engine(tiny_model_dir: Path) -> Iterator[AsyncLLMEngine]:
    engine = LLMEngine.from_pretrained(
        tiny_model_dir, num_kv_blocks=32, block_size=16, max_model_len=256, device="cpu"
    )
    eng = AsyncLLMEngine(engine)
    yield eng
    eng.shutdown()


def _idle(eng: AsyncLLMEngine) -> bool:
    """The engine holds no request and no block (stats are published by its thread)."""
    s = eng.stats()
    queued = s.num_running + s.num_waiting + s.num_waiting_remote_kv + s.num_sending_kv
    return queued == 0 and s.num_free_blocks == s.num_total_blocks


async def _wait_idle(eng: AsyncLLMEngine, timeout: float = 10.0) -> None:
    await async_wait_until(
        lambda: _idle(eng), timeout, what="the engine to hold no request or block"
    )


async def _collect(eng: AsyncLLMEngine, rid: str, params: SamplingParams) -> list[RequestOutput]:
    return [o async for o in eng.generate(rid, PROMPT, params)]


def test_streaming_matches_sync_generation(async_engine: AsyncLLMEngine) -> None:
    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        return await asyncio.gather(
            _collect(async_engine, "s1", GREEDY), _collect(async_engine, "s2", GREEDY)
        )

    first, second = asyncio.run(main())
    for outs in (first, second):
        # One output per step, unless the consumer fell behind and got several merged.
        assert all(o.new_token_ids for o in outs) and outs[-1].num_output_tokens == 8
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
        assert "".join(o.text_delta for o in outs) == outs[-1].text
    assert first[-1].token_ids == second[-1].token_ids
    asyncio.run(_wait_idle(async_engine))


def test_a_consumer_that_falls_behind_gets_the_backlog_merged(
    async_engine: AsyncLLMEngine,
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)

    async def main() -> list[RequestOutput]:
        outs = []
        async for out in async_engine.generate("slow", PROMPT, params):
            outs.append(out)
            if len(outs) == 1:  # the engine runs ahead, to the end, while nobody reads
                await _wait_idle(async_engine)
        return outs

    outs = asyncio.run(main())
    assert len(outs) < 12 and max(len(o.new_token_ids) for o in outs) > 1
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1])
    assert [t for o in outs for t in o.new_token_ids] == final.token_ids
    assert "".join(o.text_delta for o in outs) == final.text
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in logprobs] == final.token_ids
    prompt_pace = asyncio.run(_collect(async_engine, "fast", params))
    assert prompt_pace[-1].token_ids == final.token_ids


def test_validation_error_reaches_the_caller(async_engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="prompt"):
            async for _ in async_engine.generate("bad", []):
                pass
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in async_engine.generate("long", [5] * 300):
                pass
        await _wait_idle(async_engine)

    asyncio.run(main())


def test_consumer_leaving_early_aborts_and_frees_blocks(async_engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        gen = async_engine.generate("early", PROMPT * 3, params)
        got = 0
        async for _ in gen:
            got += 1
            if got == 2:
                break
        await gen.aclose()
        await _wait_idle(async_engine)

    asyncio.run(main())


def test_cancelled_task_aborts_and_frees_blocks(async_engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            async for _ in async_engine.generate("cancel", PROMPT, params):
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 30)
        assert async_engine.stats().num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(async_engine)

    asyncio.run(main())


def test_explicit_abort_ends_the_stream(async_engine: AsyncLLMEngine) -> None:
    async def main() -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        async for out in async_engine.generate("ab", PROMPT, params):
            outs.append(out)
            if len(outs) == 2:
                await async_engine.abort("ab")
        await _wait_idle(async_engine)
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs[-1].token_ids) < 200


def test_event_loop_stays_responsive_while_generating(
    async_engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = async_engine.engine.runner
    real_execute = runner.execute

    def slow_execute(out: object) -> dict:
        time.sleep(0.03)  # a device step: releases the GIL like a real kernel launch wait
        return real_execute(out)

    monkeypatch.setattr(runner, "execute", slow_execute)

    async def main() -> int:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.002)

        t = asyncio.create_task(ticker())
        await _collect(async_engine, "busy", SamplingParams(max_tokens=10, ignore_eos=True))
        done.set()
        await t
        return ticks

    # A loop blocked by the 10 steps would tick about once per step; a free one ticks
    # several times during each 30 ms step.
    assert asyncio.run(main()) >= 30


def test_remote_prefill_hooks_through_async_api(async_engine: AsyncLLMEngine) -> None:
    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        local = await _collect(async_engine, "loc", GREEDY)
        blocks = await async_engine.reserve_remote_prefill("rem", PROMPT, GREEDY)
        assert blocks is not None and len(blocks) == 1
        assert async_engine.stats().num_waiting_remote_kv == 1
        await async_engine.fail_remote_prefill("rem")  # recomputed here, same answer
        remote = [o async for o in async_engine.stream("rem")]
        await _wait_idle(async_engine)
        return local, remote

    local, remote = asyncio.run(main())
    assert remote[-1].token_ids == local[-1].token_ids
    assert remote[-1].finish_reason == "length"


def test_queries_the_servers_ask_without_reaching_into_the_engine(
    async_engine: AsyncLLMEngine,
) -> None:
    """The pool a KV receiver exports, the prefix cache as placement sees it (full blocks,
    never the last token), and the integrity check, run on the engine thread."""
    assert async_engine.kv_cache is async_engine.engine.kv_cache
    assert async_engine.block_size == 16 == async_engine.kv_cache.shape[3]
    prompt = list(range(300, 340))  # two full blocks and 8 tokens

    async def main() -> tuple[int, int]:
        before = async_engine.cached_prefix_tokens(prompt)
        outs = [o async for o in async_engine.generate("cache-me", prompt, GREEDY)]
        assert outs[-1].finished
        await async_engine.check_integrity()
        await _wait_idle(async_engine)
        return before, async_engine.cached_prefix_tokens(prompt)

    assert asyncio.run(main()) == (0, 32)
    assert async_engine.cached_prefix_tokens(prompt[:32]) == 16  # its last token is computed


def test_remote_stream_left_early_waits_for_explicit_abort(
    async_engine: AsyncLLMEngine,
) -> None:
    async def main() -> None:
        blocks = await async_engine.reserve_remote_prefill("fence", PROMPT, GREEDY)
        assert blocks is not None
        stream = async_engine.stream("fence", abort_on_exit=False)
        task = asyncio.create_task(anext(stream))
        await asyncio.sleep(0)  # the consumer queues its stream lookup on the engine thread
        # Engine commands run in order: once this one is done, so is the lookup, and the
        # consumer waits for outputs inside the stream.
        await async_engine.check_integrity()
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # An abort the consumer's exit queued would run before this command.
        await async_engine.check_integrity()
        # The peer may still be writing: the reservation must survive the consumer.
        assert async_engine.stats().num_waiting_remote_kv == 1
        await async_engine.abort("fence")
        await _wait_idle(async_engine)

    asyncio.run(main())


def test_engine_error_reaches_streams_and_later_calls(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(
        tiny_model_dir, num_kv_blocks=16, block_size=16, max_model_len=128, device="cpu"
    )

    def broken_execute(out: object) -> dict:
        raise RuntimeError("device lost")

    engine.runner.execute = broken_execute  # type: ignore[method-assign]
    eng = AsyncLLMEngine(engine)

    async def main() -> None:
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in eng.generate("x", PROMPT, GREEDY):
                pass
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate("y", PROMPT, GREEDY):
                pass

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_merge_outputs_refuses_two_requests() -> None:
    from pdserve.engine.outputs import merge_outputs

    def out(rid: str, tok: int) -> RequestOutput:
        return RequestOutput(rid, [1], [tok], [tok], "a", "a", None, False, None, 0, 0.0)

    merged = merge_outputs(out("a", 5), out("a", 6))
    assert merged.new_token_ids == [5, 6] and merged.text_delta == "aa"
    with pytest.raises(ValueError, match="request_id"):
        merge_outputs(out("a", 5), out("b", 6))


def _cpu_engine(model_dir: Path, settings: RuntimeSettings | None = None) -> LLMEngine:
    """A small CPU engine whose runtime follows ``settings`` (None: as a standalone engine)."""
    return LLMEngine.from_pretrained(
        model_dir,
        num_kv_blocks=32,
        block_size=16,
        max_model_len=256,
        device="cpu",
        runtime_settings=settings,
    )


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity")
def test_engine_thread_binds_to_its_cpus_and_nothing_else_moves(tiny_model_dir: Path) -> None:
    before = os.sched_getaffinity(0)
    cpu = max(before)

    def fresh(settings: RuntimeSettings | None = None) -> LLMEngine:
        return _cpu_engine(tiny_model_dir, settings)

    eng = AsyncLLMEngine(fresh(RuntimeSettings(cpu_bind=str(cpu))))
    try:
        assert eng.describe_runtime().engine_cpus == (cpu,)
        on_thread = asyncio.run(eng._call(lambda: os.sched_getaffinity(0)))
        assert on_thread == {cpu}
        outs = asyncio.run(_collect(eng, "bound", GREEDY))  # it still serves
        assert outs[-1].num_output_tokens == 8
        assert os.sched_getaffinity(0) == before  # the caller's thread did not move
    finally:
        eng.shutdown()
    unbound = AsyncLLMEngine(fresh())
    try:
        assert unbound.describe_runtime().engine_cpus == ()
    finally:
        unbound.shutdown()


def _thread_cpus_and_nice() -> list[tuple[frozenset[int], int]]:
    """Every thread of this process: its CPUs and niceness."""
    found = []
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            found.append(
                (frozenset(os.sched_getaffinity(tid)), os.getpriority(os.PRIO_PROCESS, tid))
            )
    return found


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs thread affinity and two CPUs",
)
def test_helper_threads_run_big_steps_on_the_other_cpus(tiny_model_dir: Path) -> None:
    """The engine thread keeps its CPU; a niced helper goes to the process's other CPUs and
    joins only steps of >= helper_min_tokens tokens; the tokens are those of an engine
    without helpers (the linears' dynamic split changes no sum)."""
    from pdserve.kernels.cpu import native
    from pdserve.kernels.cpu.runtime import HELPER_NICE

    if not native.available():
        pytest.skip("no native kernels")
    torch_threads = torch.get_num_threads()
    before = os.sched_getaffinity(0)
    cpu = max(before)
    others = frozenset(before - {cpu})
    long_prompt = list(range(5, 5 + 100))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(eng: AsyncLLMEngine) -> list[int]:
        async def collect() -> list[RequestOutput]:
            return [o async for o in eng.generate("long", long_prompt, params)]

        return asyncio.run(collect())[-1].token_ids

    def fresh(settings: RuntimeSettings) -> LLMEngine:
        return _cpu_engine(tiny_model_dir, settings)

    plain = AsyncLLMEngine(fresh(RuntimeSettings(cpu_bind=str(cpu))))
    try:
        want = run(plain)
        assert plain.describe_runtime().helper_cpus == ()
    finally:
        plain.shutdown()
    helped = RuntimeSettings(cpu_bind=str(cpu), helper_threads=1, helper_min_tokens=64)
    eng = AsyncLLMEngine(fresh(helped))
    try:
        assert eng.describe_runtime().engine_cpus == (cpu,)
        assert eng.describe_runtime().helper_cpus == tuple(sorted(others))
        policy = eng.engine.runtime.step_threads
        assert policy is not None and (policy.total, policy.min_tokens) == (policy.base + 1, 64)
        assert policy.base == 1  # one thread per bound CPU
        assert run(eng) == want
        threads = _thread_cpus_and_nice()
        assert any(cpus == others and nice >= HELPER_NICE for cpus, nice in threads)
        assert os.sched_getaffinity(0) == before  # the caller's thread did not move
    finally:
        eng.shutdown()
        torch.set_num_threads(torch_threads)
    with pytest.raises(ValueError, match="helper_threads"):
        RuntimeSettings(helper_threads=-1)
