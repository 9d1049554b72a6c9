"""A small client for pdserve's gRPC API (through Ray Serve's gRPC proxy).

    python -m pdserve.deployments.grpc.client --target 127.0.0.1:9000 "Once upon a time"
    python -m pdserve.deployments.grpc.client --target 127.0.0.1:9000 --chat --no-stream "Hi!"

Streams the text to stdout as it arrives, then prints the usage to stderr. As a library:
``PDServeClient(target).generate(prompt=...)`` yields ``CompletionChunk``s and
``.complete(...)`` returns a ``CompletionResult``. Serve routes by the ``application``
metadata when several applications are deployed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from pdserve.deployments.grpc import pdserve_pb2 as pb2
from pdserve.deployments.grpc import pdserve_pb2_grpc as pb2_grpc

SERVE_HEALTHZ = "/ray.serve.RayServeAPIService/Healthz"


class PDServeClient:
    """Blocking client; one channel, reused across calls. Use as a context manager."""

    def __init__(
        self, target: str, *, application: str | None = None, timeout_s: float = 300.0
    ) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = pb2_grpc.PDServeStub(self._channel)
        self._metadata = (("application", application),) if application else ()
        self._timeout_s = timeout_s

    def __enter__(self) -> PDServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    @staticmethod
    def request(
        prompt: str = "", messages: Sequence[tuple[str, str]] = (), **params: Any
    ) -> pb2.CompletionRequest:
        """A ``CompletionRequest``: ``prompt`` or ``messages`` ((role, content) pairs) plus
        any of max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids,
        prompt_token_ids, logprobs, ignore_eos, min_tokens, model, request_id (None values
        are left unset)."""
        fields = {k: v for k, v in params.items() if v is not None}
        chat = [pb2.ChatMessage(role=role, content=content) for role, content in messages]
        return pb2.CompletionRequest(prompt=prompt, messages=chat, **fields)

    def generate(self, request: pb2.CompletionRequest) -> Iterator[pb2.CompletionChunk]:
        """Stream the completion; the last chunk has ``finish_reason`` and ``usage``."""
        yield from self._stub.Generate(request, metadata=self._metadata, timeout=self._timeout_s)

    def complete(self, request: pb2.CompletionRequest) -> pb2.CompletionResult:
        return self._stub.Complete(request, metadata=self._metadata, timeout=self._timeout_s)

    def serving(self) -> bool:
        """``grpc.health.v1.Health/Check`` answers SERVING (every pool has a replica)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), metadata=self._metadata, timeout=10)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def healthy(self) -> bool:
        """Serve's own gRPC health check answers OK."""
        healthz = self._channel.unary_unary(
            SERVE_HEALTHZ, request_serializer=lambda _: b"", response_deserializer=bytes
        )
        try:
            healthz(None, timeout=10)
        except grpc.RpcError:
            return False
        return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.deployments.grpc.client", description=__doc__
    )
    p.add_argument("prompt", help="the prompt (with --chat: the user message)")
    p.add_argument("--target", required=True, help="HOST:PORT of Serve's gRPC proxy")
    p.add_argument("--application", default=None, help="Serve application name")
    p.add_argument("--chat", action="store_true", help="send as a chat message")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-stream", action="store_true", help="use the unary Complete RPC")
    args = p.parse_args(argv)

    messages: list[tuple[str, str]] = []
    if args.chat:
        if args.system:
            messages.append(("system", args.system))
        messages.append(("user", args.prompt))
    request = PDServeClient.request(
        prompt="" if args.chat else args.prompt,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos or None,
    )
    with PDServeClient(args.target, application=args.application) as client:
        try:
            if args.no_stream:
                result = client.complete(request)
                sys.stdout.write(result.text)
                usage, finish = result.usage, result.finish_reason
            else:
                usage, finish = pb2.Usage(), ""
                for chunk in client.generate(request):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    if chunk.finish_reason:
                        usage, finish = chunk.usage, chunk.finish_reason
        except grpc.RpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    print(
        f"[finish_reason={finish} prompt_tokens={usage.prompt_tokens} "
        f"completion_tokens={usage.completion_tokens} cached_tokens={usage.cached_tokens}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
