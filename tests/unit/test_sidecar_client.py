"""The client side of sidecar mode: where the sidecar is, trainer-held pins, giving up."""

from __future__ import annotations

import functools
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from shardcache import contract, errors, sidecar_client, unix_http
from shardcache.node import leases
from tests.support.locks import exclusively_lockable

pytestmark = pytest.mark.unit


def test_socket_and_memory_dir_come_from_run_dir_and_mount() -> None:
    s = sidecar_client.ClientSettings.from_env(
        {contract.ENV_RUN_DIR: "/r", contract.ENV_MOUNT: "m"}
    )
    assert (s.socket_path, s.memory_dir) == (Path("/r/m/control.sock"), Path("/r/m/mem"))
    assert s.reconnect_timeout == 120.0


def test_an_explicit_socket_wins_and_the_memory_dir_sits_beside_it() -> None:
    env = {contract.ENV_SOCKET: "/x/control.sock", contract.ENV_MOUNT: "m"}
    s = sidecar_client.ClientSettings.from_env(env, reconnect_timeout=5)
    assert (s.socket_path, s.memory_dir, s.reconnect_timeout) == (
        Path("/x/control.sock"),
        Path("/x/mem"),
        5,
    )
    assert sidecar_client.ClientSettings.from_env(env, mount="other").socket_path == Path(
        "/x/control.sock"
    )


def test_the_reconnect_timeout_comes_from_the_environment_unless_given() -> None:
    env = {contract.ENV_SOCKET: "/x/control.sock", contract.ENV_RECONNECT_TIMEOUT: "7.5"}
    assert sidecar_client.ClientSettings.from_env(env).reconnect_timeout == 7.5
    assert sidecar_client.ClientSettings.from_env(env, reconnect_timeout=3).reconnect_timeout == 3
    with pytest.raises(errors.InputError, match="expected seconds as a number, found 'soon'"):
        sidecar_client.ClientSettings.from_env({**env, contract.ENV_RECONNECT_TIMEOUT: "soon"})


def test_without_a_uri_or_sidecar_variables_the_error_says_what_to_do() -> None:
    with pytest.raises(errors.InputError, match=contract.ENV_MOUNT) as info:
        sidecar_client.ClientSettings.from_env({})
    assert "embedded mode" in str(info.value)


def test_a_socket_path_too_long_for_af_unix_is_refused_up_front() -> None:
    with pytest.raises(errors.InputError, match="at most 107"):
        sidecar_client.ClientSettings.from_env({contract.ENV_SOCKET: "/" + "s" * 120})


def test_an_absent_sidecar_raises_unavailable_naming_socket_and_wait() -> None:
    # A short directory: pytest's tmp_path can exceed the 107-byte socket path limit.
    short = Path(tempfile.mkdtemp(prefix="scu-", dir="/tmp"))
    path = short / "control.sock"
    settings = sidecar_client.ClientSettings(path, short / "mem", reconnect_timeout=0.3)
    with pytest.raises(errors.SidecarUnavailableError) as info:
        sidecar_client.SidecarProvider(settings)
    assert str(path) in str(info.value) and "waited 0.3 s" in str(info.value)
    # A socket file with nobody listening (a killed sidecar) is the same.
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))
    try:
        with pytest.raises(errors.SidecarUnavailableError, match="Connection refused"):
            sidecar_client.SidecarProvider(settings)
    finally:
        shutil.rmtree(short)


def test_a_pin_blocks_eviction_until_released(tmp_path: Path) -> None:
    data, lock = tmp_path / "k", tmp_path / "k.lock"
    data.write_bytes(b"x")
    lock.touch()
    pinned = leases.pin(data, lock)
    assert pinned is not None and pinned.path == data
    assert not exclusively_lockable(lock)
    pinned.release()
    pinned.release()
    assert exclusively_lockable(lock) and not pinned.held


def test_a_dropped_pin_unpins_when_collected(tmp_path: Path) -> None:
    data, lock = tmp_path / "k", tmp_path / "k.lock"
    data.write_bytes(b"x")
    lock.touch()
    pinned = leases.pin(data, lock)
    assert pinned is not None
    del pinned
    assert exclusively_lockable(lock)


def test_pinning_an_entry_that_went_away_returns_none(tmp_path: Path) -> None:
    data, lock = tmp_path / "k", tmp_path / "k.lock"
    assert leases.pin(data, lock) is None  # no lock file: never created by pin
    assert not lock.exists()
    lock.touch()
    assert leases.pin(data, lock) is None  # lock file but no data


def test_a_pin_with_an_expected_size_refuses_a_data_file_of_another_size(tmp_path: Path) -> None:
    data, lock = tmp_path / "k", tmp_path / "k.lock"
    data.write_bytes(b"xyz")
    lock.touch()
    assert leases.pin(data, lock, 4) is None
    assert exclusively_lockable(lock)  # a refused pin holds nothing
    pinned = leases.pin(data, lock, 3)
    assert pinned is not None and not exclusively_lockable(lock)
    pinned.release()


def test_the_notifier_runs_calls_in_order_survives_a_failing_one_and_drains_on_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    notifier = sidecar_client._Notifier()
    ran: list[int] = []
    gate = threading.Event()

    def fail() -> None:
        raise RuntimeError("sidecar said no")

    def blocked() -> None:
        gate.wait(10)  # everything below queues up behind this

    notifier.submit(blocked)
    for i in range(5):
        notifier.submit(functools.partial(ran.append, i))
        if i == 2:
            notifier.submit(fail)
    assert not notifier.flush(0.05)  # still blocked
    gate.set()
    assert notifier.flush(10)
    assert ran == [0, 1, 2, 3, 4]
    notifier.submit(functools.partial(ran.append, 9))
    notifier.close()  # waits for everything queued before it
    assert ran == [0, 1, 2, 3, 4, 9]
    assert any("sidecar said no" in r.exc_text for r in caplog.records if r.exc_text)
    notifier.submit(functools.partial(ran.append, 5))  # usable again after close
    notifier.close()
    assert ran[-1] == 5


def test_an_answer_nested_too_deeply_is_a_rejection_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    deep = b"[" * 100_000

    def exchange(*args: object, **kwargs: object) -> tuple[int, bytes]:
        return 400, deep

    monkeypatch.setattr(unix_http, "exchange", exchange)
    settings = sidecar_client.ClientSettings(Path("/tmp/scu-none.sock"), Path("/tmp/scu-mem"))
    transport = sidecar_client.Transport(settings)
    try:
        with pytest.raises(sidecar_client.Rejected) as info:
            transport.call("GET", "/v1/manifest", retry=False)
    finally:
        transport.close()
    assert info.value.wire.status == 400
    assert "unexpected response body: '[[[" in info.value.wire.message
    assert len(info.value.wire.message) < 1000
