"""The ports the farm gives the processes it starts (farm.core.host.free_port): free, and out of the
kernel's ephemeral range, which every process that binds port 0 or connects draws from."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import farm.core.host
from farm.core.host import PORTS_FROM, free_port


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_lie_below_the_ephemeral_range_and_can_be_listened_on() -> None:
    low = _ephemeral_low()
    assert low - PORTS_FROM >= 1000, "this machine's ephemeral range leaves no room below it"
    ports = {free_port() for _ in range(50)}
    assert all(PORTS_FROM <= p < low for p in ports)
    assert len(ports) > 40  # drawn at random: two farms starting at once rarely draw the same
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_without_the_range_file_an_ephemeral_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(farm.core.host, "_EPHEMERAL_RANGE", tmp_path / "missing")
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_process_never_gets_one_port_twice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The ports are bound later, by the processes started next: without memory, 300 draws from
    1,000 ports would repeat one about 45 times over."""
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{PORTS_FROM + 1000}\t60999\n")
    monkeypatch.setattr(farm.core.host, "_EPHEMERAL_RANGE", narrow)
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
