"""`listening.free_port`: the port a started process is told to listen on."""

from __future__ import annotations

import errno
import socket

import pytest
from shardcache_sidecar import listening


def test_ports_are_drawn_outside_the_kernels_ephemeral_range_and_never_twice() -> None:
    # Inside the ephemeral range any outgoing connection may take the port before
    # the child binds it; and two ports asked in a row (metrics and UI) must differ.
    low, high = listening.ephemeral_range()
    ports = [listening.free_port() for _ in range(200)]
    if not listening.outside_ephemeral((low, high)):
        pytest.fail(f"this machine's ephemeral range {low}-{high} leaves no port outside it")
    assert not [p for p in ports if low <= p <= high]
    assert len(set(ports)) == len(ports)


def test_the_ranges_drawn_from_keep_clear_of_ephemeral_and_node_ports() -> None:
    # Nor kube-proxy's NodePorts (30000-32767), which it forwards on the node's addresses.
    assert listening.outside_ephemeral((32768, 60999)) == [range(16384, 30000), range(61000, 65536)]
    assert listening.outside_ephemeral((2000, 65535)) == [range(1024, 2000)]
    assert listening.outside_ephemeral((1024, 65535)) == []


def test_a_port_another_socket_holds_is_never_handed() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises(OSError) as raised:
            listening.free_port(within=[range(port, port + 1)])
    assert raised.value.errno == errno.EADDRINUSE
    assert f"in [range({port}, {port + 1})]" in str(raised.value)


def test_a_port_handed_once_is_not_handed_again_even_when_still_free() -> None:
    port = listening.free_port()
    with pytest.raises(OSError):
        listening.free_port(within=[range(port, port + 1)])


def test_with_no_room_outside_the_ephemeral_range_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(listening, "ephemeral_range", lambda: (1024, 65535))
    port = listening.free_port()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))
