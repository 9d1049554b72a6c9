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


class PortAllocator:
    """Hands out OS-chosen free ports on one address, never the same port twice.

    Each ``free_port`` call releases its port at once, so two calls can get the same number
    back from the OS; the services they are for bind only later. One allocator per cluster
    start keeps the numbers it hands out distinct.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self._given: set[int] = set()

    def take(self) -> int:
        for _ in range(64):
            port = free_port(self.host)
            if port not in self._given:
                self._given.add(port)
                return port
        raise RuntimeError(f"no new free port on {self.host} after 64 tries")


def free_port_all_interfaces() -> int:
    """A port free on every interface, for services that bind the wildcard address.

    Ray Serve's gRPC proxy listens on ``[::]:PORT`` whatever the node address is (Ray 2.60
    has no host option for it), so a port that is only free on 127.0.0.2 can still collide.
    """
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        address: tuple = ("::", 0)
    except OSError:  # no IPv6: the IPv4 wildcard is what a bind to [::] falls back to
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = ("0.0.0.0", 0)
    with sock:
        sock.bind(address)
        return int(sock.getsockname()[1])
