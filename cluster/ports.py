"""Ask the OS for a free TCP port on an address (no fixed ports anywhere in pdserve)."""

from __future__ import annotations

import socket

# Ports Ray's own processes bind by default whatever the cluster asks for (the autoscaler's
# and the dashboard's metrics, the dashboard agent, the GCS, the dashboard, Ray Client,
# Serve's HTTP and gRPC): one of these handed out before Ray starts is taken by Ray a
# moment later, and the service it was for fails to bind.
RAY_DEFAULT_PORTS = frozenset({44217, 44227, 52365, 6379, 8265, 10001, 8000, 9000})


def free_port(host: str) -> int:
    """A port the OS just handed out on ``host``; free again when this returns.

    Ray and Serve need the number up front (workers join the GCS at it, the CLI prints the
    endpoint), so the port is picked here and bound by the service a moment later. Never
    one of ``RAY_DEFAULT_PORTS``.
    """
    return _os_port(socket.AF_INET, (host, 0))


def _os_port(family: socket.AddressFamily, address: tuple) -> int:
    for _ in range(64):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind(address)
            port = int(sock.getsockname()[1])
        if port not in RAY_DEFAULT_PORTS:
            return port
    raise RuntimeError(f"the OS gave only Ray's default ports on {address[0]} in 64 tries")


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
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:  # no IPv6: the IPv4 wildcard is what a bind to [::] falls back to
        return _os_port(socket.AF_INET, ("0.0.0.0", 0))
    return _os_port(socket.AF_INET6, ("::", 0))
