"""An ASGI app served by uvicorn on a thread of the test process, on an OS-given port."""

from __future__ import annotations

import socket
import threading
from typing import Any

import uvicorn

from tests.support import LOOPBACK, wait_until


class ThreadedServer:
    """Serves ``app`` on ``127.0.0.1`` from a daemon thread. The socket is bound before the
    server starts, so no other process can take the port in between."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 10.0) -> str:
        """Start serving and return the base URL once uvicorn reports it has started."""
        self._sock = socket.socket()
        self._sock.bind((LOOPBACK, 0))
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        server = self._server
        wait_until(lambda: server.started, timeout_s, what="uvicorn to start")
        return f"http://{LOOPBACK}:{self._sock.getsockname()[1]}"

    def stop(self) -> None:
        """Ask uvicorn to exit and join its thread; a no-op when not started."""
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(timeout=10)
            self._server = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
