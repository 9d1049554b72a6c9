"""bench/reject_floor.py's servers and raw client (the Serve targets need a Ray cluster:
run the module)."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import uvicorn

from pdserve.bench.reject_floor import _starlette_app, raw_burst


def test_the_bare_server_refuses_every_request_of_a_raw_burst_with_429() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_starlette_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.05)
        answers = asyncio.run(raw_burst("127.0.0.1", port, 20, "floor"))
        assert [status for status, _ in answers] == [429] * 20
        assert all(took > 0 for _, took in answers)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == 429
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
