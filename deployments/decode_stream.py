"""``DecodeStream``: one request's ``GenerateChunk`` stream from the decode pool, as the
ingress consumes it.

It turns the pool's failures into ``OpenAIError``s (an up-front rejection before any
response header is sent; a failure part-way as an error the SSE writer reports), keeps the
usage counts, and guarantees that an unfinished stream is cancelled downstream when closed.
It knows nothing of HTTP or Ray.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from pdserve.deployments.messages import ErrorInfo, GenerateChunk, GenerateRequest
from pdserve.deployments.openai_protocol import OpenAIError, UsageInfo


def error_from_info(info: ErrorInfo) -> OpenAIError:
    return OpenAIError(
        info.message,
        status_code=info.code,
        type=info.type,
        code=str(info.code),
        retry_after_s=info.retry_after_s,
    )


class DecodeStream:
    """The chunks of one request from the decode pool, with usage bookkeeping.

    ``open()`` waits for the first chunk so that a request the pool rejects up front (shed
    with 429/503, or invalid) becomes an HTTP error before any response header is sent.
    Iterating raises ``OpenAIError`` when the stream fails part-way. ``close()`` must be
    called (it is idempotent): closing an unfinished stream cancels the request downstream.
    """

    def __init__(
        self,
        request: GenerateRequest,
        chunks: AsyncGenerator[GenerateChunk, None],
        on_close: Callable[[DecodeStream, BaseException | None], None] | None = None,
    ) -> None:
        self.request = request
        self._chunks = chunks
        self._on_close = on_close
        self._closed = False
        self.error: BaseException | None = None
        self._first: GenerateChunk | None = None
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.first_token_time: float | None = None

    async def open(self) -> None:
        try:
            self._first = await anext(self._chunks)
        except StopAsyncIteration:
            raise OpenAIError(
                "the decode server ended the stream without output",
                status_code=500,
                type="server_error",
            ) from None
        except OpenAIError:
            raise
        except Exception as err:  # a replica died, the handle failed...
            raise _server_error(err) from err
        if self._first.error is not None and not self._first.token_ids:
            raise error_from_info(self._first.error)

    async def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        try:
            async for chunk in self._iterate():
                yield chunk
        except BaseException as err:  # incl. cancellation when the client goes away
            self.error = err
            raise

    async def _iterate(self) -> AsyncIterator[GenerateChunk]:
        if self._first is None:
            await self.open()
        chunk: GenerateChunk | None = self._first
        self._first = None
        while chunk is not None:
            self._account(chunk)
            if chunk.error is not None:
                raise error_from_info(chunk.error)
            if chunk.finish_reason in ("abort", "error"):
                raise OpenAIError(
                    f"the request was aborted by the server ({chunk.finish_reason})",
                    status_code=500,
                    type="server_error",
                )
            yield chunk
            if chunk.finish_reason is not None:
                return
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                raise OpenAIError(
                    "the decode server ended the stream before the request finished",
                    status_code=500,
                    type="server_error",
                ) from None
            except Exception as err:
                raise _server_error(err) from err

    def _account(self, chunk: GenerateChunk) -> None:
        if chunk.num_prompt_tokens:
            self.num_prompt_tokens = chunk.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if chunk.token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.num_output_tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason

    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    async def close(self, error: BaseException | None = None) -> None:
        """Release the stream (cancelling it downstream if unfinished); idempotent."""
        if self._closed:
            return
        self._closed = True
        if error is not None:
            self.error = error
        if self.error is None and self.finish_reason is None:
            self.error = OpenAIError("the response was not consumed to the end", status_code=499)
        try:
            await self._chunks.aclose()
        finally:
            if self._on_close is not None:
                self._on_close(self, self.error)


def _server_error(err: Exception) -> OpenAIError:
    return OpenAIError(
        f"internal error while generating: {type(err).__name__}: {err}",
        status_code=500,
        type="server_error",
    )
