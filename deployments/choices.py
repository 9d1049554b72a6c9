"""``Choices``: the ``n`` decode streams of one OpenAI request (``n`` > 1 asks for several
independent samples of the same prompt), read together.

Choice ``i`` is its own ``GenerateRequest`` (id ``<id>-<i>``, seed ``seed + i`` when seeded)
so that the decode pool batches, routes and cancels each like any other request. Usage
counts the prompt once, as OpenAI does, and sums the completions. Knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pdserve.deployments.decode_stream import DecodeStream
from pdserve.deployments.messages import GenerateChunk
from pdserve.deployments.openai_protocol import UsageInfo

_DONE = object()


class Choices:
    """The streams of choices 0..n-1; ``close()`` closes (and so cancels) every one."""

    def __init__(self, request_id: str, streams: list[DecodeStream]) -> None:
        if not streams:
            raise ValueError("Choices needs at least one stream")
        self.request_id = request_id
        self.streams = streams

    @property
    def finish_reasons(self) -> list[str | None]:
        return [s.finish_reason for s in self.streams]

    # What the root span and the ingress metrics read (as of a DecodeStream).
    @property
    def num_prompt_tokens(self) -> int:
        return self.streams[0].num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.streams)

    @property
    def first_token_time(self) -> float | None:
        times = [s.first_token_time for s in self.streams if s.first_token_time is not None]
        return min(times) if times else None

    def usage(self) -> UsageInfo:
        first = self.streams[0]
        completion = sum(s.num_output_tokens for s in self.streams)
        return UsageInfo.of(first.num_prompt_tokens, completion, first.num_cached_tokens)

    async def merged(self) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """``(choice index, chunk)`` in arrival order; raises the first stream's failure."""
        if len(self.streams) == 1:
            async for chunk in self.streams[0]:
                yield 0, chunk
            return
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

        async def pump(index: int, stream: DecodeStream) -> None:
            try:
                async for chunk in stream:
                    await queue.put((index, chunk))
                await queue.put((index, _DONE))
            except BaseException as err:  # handed to the reader, who raises it
                await queue.put((index, err))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item  # type: ignore[misc]
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task

    async def close(self, error: BaseException | None = None) -> None:
        for stream in self.streams:
            await stream.close(error)
