"""OS-chosen ports: a cluster start must never hand two Ray components the same one."""

from __future__ import annotations

import socket

from pdserve.cluster.ports import PortAllocator, free_port_all_interfaces


def test_allocator_never_repeats_a_port(monkeypatch) -> None:
    # The OS may hand a just-released port out again; simulate it doing so every time.
    handed = iter([5001, 5001, 5002, 5001, 5002, 5003])
    monkeypatch.setattr("pdserve.cluster.ports.free_port", lambda host: next(handed))
    ports = PortAllocator("127.0.0.2")
    assert [ports.take(), ports.take(), ports.take()] == [5001, 5002, 5003]


def test_allocated_ports_are_bindable_and_distinct() -> None:
    ports = PortAllocator("127.0.0.1")
    taken = [ports.take() for _ in range(12)]
    assert len(set(taken)) == 12
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", taken[0]))


def test_wildcard_port_is_free_on_loopback_too() -> None:
    port = free_port_all_interfaces()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_rays_own_default_ports_are_never_handed_out(monkeypatch) -> None:
    """Ray binds its autoscaler's metrics port (44217) and others whatever the cluster
    asks: a port the OS hands out that is one of them is skipped."""
    from pdserve.cluster import ports

    given = iter([44217, 44227, 5005])

    class _Socket:
        def __init__(self, *args: object) -> None:
            self.port = 0

        def __enter__(self) -> _Socket:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple) -> None:
            self.port = next(given)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.2", self.port)

    monkeypatch.setattr(ports.socket, "socket", _Socket)
    assert ports.free_port("127.0.0.2") == 5005
    assert {44217, 44227} <= ports.RAY_DEFAULT_PORTS
