"""A scripted OpenAI-compatible streaming server for the load-generator tests: known TTFT,
inter-token gaps and token counts, so the measured numbers can be checked exactly."""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

TTFT_S = 0.10
ITL_S = 0.03
TOKENS_PER_CHUNK = 2  # so that counting chunks instead of usage would give wrong numbers
FAIL_AT = 13  # max_tokens that makes the fake fail after its first chunk
CACHED_TOKENS = 3  # of its 7 prompt tokens, reported in usage.prompt_tokens_details


class FakeOpenAI:
    """Streams ``max_tokens`` tokens, two per chunk: first text after TTFT_S, then one chunk
    every ITL_S, then a usage chunk. Chat streams open with an empty role chunk at once."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.complete, methods=["POST"]),
                Route("/v1/chat/completions", self.complete, methods=["POST"]),
            ]
        )

    async def models(self, _: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def complete(self, request: Request) -> StreamingResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        n = body.get("max_tokens") or body["max_completion_tokens"]

        def chunk(text: str, usage: dict | None = None, empty: bool = False) -> str:
            if chat:
                choices = [{"index": 0, "delta": {"content": text}}]
            else:
                choices = [{"index": 0, "text": text}]
            obj = {"id": "x", "choices": [] if empty else choices, "usage": usage}
            return f"data: {json.dumps(obj)}\n\n"

        async def events():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                async for event in script():
                    yield event
            finally:
                self.in_flight -= 1

        async def script():
            if chat:
                yield chunk("")  # role chunk: must not count as the first token
            await asyncio.sleep(TTFT_S)
            for i in range(n // TOKENS_PER_CHUNK):
                if i:
                    await asyncio.sleep(ITL_S)
                yield chunk("ab")
                if n == FAIL_AT:
                    yield 'data: {"error": {"message": "replica died", "type": "server_error"}}\n\n'
                    yield "data: [DONE]\n\n"
                    return
            usage = {
                "prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n,
                "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
            }  # fmt: skip
            yield chunk("", usage, empty=True)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
