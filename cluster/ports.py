"""Ask the OS for a free TCP port on an address (no fixed ports anywhere in pdserve)."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port the OS just handed out on ``host``; free again when this returns.

    Ray and Serve need the number up front (workers join the GCS at it, the CLI prints the
    endpoint), so the port is picked here and bound by the service a moment later.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
