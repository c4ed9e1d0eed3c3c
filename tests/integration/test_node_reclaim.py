"""The node-cache DaemonSet's reclaim over a real node path: tiers made by
`shardcache.node.tiers`, other processes holding their locks, links and API failures.

A deleted namespace's directory is removed (its bytes said), and so is the one of a
namespace deleted and created again with the same name (keyed by the earlier UID), and a
legacy `ns-<namespace>` once the live namespace's keyed one exists; one a live process
uses (a lease, the tier lock) is kept until a round finds it unused; a live namespace's,
a link's (and what it points at) and everything when the namespace list fails are
never touched. Several node paths (`policy.nodePaths`) in one process: each path's
tiers and their holders its own, one path that cannot be read said and passed over."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from shardcache_operator import node_reclaim, reclaim_decisions

from shardcache import errors
from shardcache.node import tiers

pytestmark = pytest.mark.integration

KEY = f"{0:064x}"  # the first entry `make_tier` makes
LIVE = "0b6c1f2e-3d4a-4b5c-8d6e-7f8091a2b3c4"
EARLIER = "9e8d7c6b-5a49-4382-b716-0a1b2c3d4e5f"


def make_tier(directory: Path, entries: int = 3, size: int = 1000) -> int:
    """A disk tier with `entries` committed entries; the bytes of their data files."""
    tier = tiers.Tier(directory, limit_bytes=10**7, name="disk")
    for i in range(entries):
        tier.insert(f"{i:064x}", size, lambda p: p.write_bytes(b"x" * size)).release()
    return entries * size


@contextlib.contextmanager
def holder(directory: Path, what: str) -> Iterator[subprocess.Popen[str]]:
    """Another process that holds `what` until killed: "lease" (a lookup's, on KEY),
    "declaration" (of a process that inserted and released: a live sidecar's limit in
    `.limits/`) or "tier lock"."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from shardcache.node import _locks, tiers
        root = Path({str(directory)!r})
        tier = tiers.Tier(root, limit_bytes=10**7, name="disk")
        if {what!r} == "lease":
            held = tier.lookup({KEY!r})
            assert held is not None
        elif {what!r} == "declaration":
            tier.insert("b" * 64, 10, lambda p: p.write_bytes(b"y" * 10)).release()
        else:
            held = _locks.acquire(root / tiers.TIER_LOCK_NAME, _locks.EXCLUSIVE, create=True)
        print("held", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_deleted_namespaces_tier_is_removed_and_a_live_ones_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gone = make_tier(tmp_path / f"ns-gone.{EARLIER}")
    make_tier(tmp_path / f"ns-live.{LIVE}")
    with caplog.at_level(logging.INFO, logger=node_reclaim.__name__):
        done = node_reclaim.reclaim_round(tmp_path, lambda: {"live": LIVE, "default": EARLIER})
    assert not (tmp_path / f"ns-gone.{EARLIER}").exists()
    assert done.removed[f"ns-gone.{EARLIER}"] >= gone
    assert sorted(os.listdir(tmp_path)) == [f"ns-live.{LIVE}"], "nothing left aside"
    live = tiers.Tier(tmp_path / f"ns-live.{LIVE}", limit_bytes=10**7, name="disk")
    assert len(live.keys()) == 3
    assert "(deleted namespace gone)" in caplog.text
    assert f"{done.removed[f'ns-gone.{EARLIER}']} bytes" in caplog.text


def test_a_namespace_created_again_loses_its_predecessors_tier_and_keeps_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`team` deleted and created again: its name is live, its earlier UID is not."""
    make_tier(tmp_path / f"ns-team.{EARLIER}")
    make_tier(tmp_path / f"ns-team.{LIVE}")
    with caplog.at_level(logging.INFO, logger=node_reclaim.__name__):
        done = node_reclaim.reclaim_round(tmp_path, lambda: {"team": LIVE})
    assert list(done.removed) == [f"ns-team.{EARLIER}"]
    assert os.listdir(tmp_path) == [f"ns-team.{LIVE}"]
    assert f"(deleted namespace team UID {EARLIER}; the live one's UID is {LIVE})" in caplog.text


def test_a_legacy_tier_goes_once_unused_and_its_live_namespaces_keyed_one_exists(
    tmp_path: Path,
) -> None:
    """`ns-<namespace>`, from pods injected before the UID keyed it: kept while the live
    namespace has no keyed directory here, and while a pod injected before still holds
    a lease in it."""
    make_tier(tmp_path / "ns-team")
    done = node_reclaim.reclaim_round(tmp_path, lambda: {"team": LIVE})
    assert not done.removed and os.listdir(tmp_path) == ["ns-team"]
    make_tier(tmp_path / f"ns-team.{LIVE}")
    with holder(tmp_path / "ns-team", "lease"):
        done = node_reclaim.reclaim_round(tmp_path, lambda: {"team": LIVE})
        assert done.kept == {"ns-team": f"a process holds {KEY}.lock"}
    done = node_reclaim.reclaim_round(tmp_path, lambda: {"team": LIVE})
    assert list(done.removed) == ["ns-team"]
    assert os.listdir(tmp_path) == [f"ns-team.{LIVE}"]
    done = node_reclaim.reclaim_round(tmp_path, lambda: {})
    assert list(done.removed) == [f"ns-team.{LIVE}"]


def test_a_tier_with_a_live_lease_of_another_process_is_kept_until_released(
    tmp_path: Path,
) -> None:
    make_tier(tmp_path / "ns-gone")
    with holder(tmp_path / "ns-gone", "lease"):
        done = node_reclaim.reclaim_round(tmp_path, lambda: {})
        assert done.kept == {"ns-gone": f"a process holds {KEY}.lock"}
        assert not done.removed
        assert len(tiers.Tier(tmp_path / "ns-gone", limit_bytes=10**7, name="disk").keys()) == 3
        assert os.listdir(tmp_path) == ["ns-gone"], "nothing renamed aside"
    done = node_reclaim.reclaim_round(tmp_path, lambda: {})
    assert "ns-gone" in done.removed
    assert os.listdir(tmp_path) == []


def test_a_tier_a_live_inserting_process_declared_its_limit_in_is_kept(tmp_path: Path) -> None:
    make_tier(tmp_path / "ns-gone")
    with holder(tmp_path / "ns-gone", "declaration"):
        done = node_reclaim.reclaim_round(tmp_path, lambda: {})
        assert done.kept["ns-gone"].startswith("a process holds .limits/")
        assert (tmp_path / "ns-gone").is_dir()


def test_a_tier_whose_tier_lock_is_held_is_kept(tmp_path: Path) -> None:
    make_tier(tmp_path / "ns-gone")
    with holder(tmp_path / "ns-gone", "tier lock"):
        done = node_reclaim.reclaim_round(tmp_path, lambda: {})
        assert done.kept == {"ns-gone": "its tier lock is held"}
        assert (tmp_path / "ns-gone").is_dir()


def test_a_link_at_a_namespace_name_is_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "node"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    data = make_tier(elsewhere)
    (root / "ns-gone").symlink_to(elsewhere)
    (root / "ns-file").write_text("not a tier")
    done = node_reclaim.reclaim_round(root, lambda: {})
    assert done.kept == {
        "ns-gone": "a symbolic link, not a directory: left alone",
        "ns-file": "a regular file, not a directory: left alone",
    }
    assert (root / "ns-gone").is_symlink() and (root / "ns-file").read_text() == "not a tier"
    assert sum(p.stat().st_size for p in elsewhere.iterdir() if len(p.name) == 64) == data


def test_a_link_inside_a_removed_tier_is_removed_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "node"
    make_tier(root / "ns-gone")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    (root / "ns-gone" / "link").symlink_to(outside)
    node_reclaim.reclaim_round(root, lambda: {})
    assert os.listdir(root) == []
    assert (outside / "keep").read_text() == "keep"


def test_nothing_is_removed_when_the_namespace_list_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_tier(tmp_path / "ns-gone")

    def failing() -> dict[str, str]:
        raise ConnectionRefusedError("connection refused")

    done = node_reclaim.reclaim_round(tmp_path, failing)
    assert done.skipped is not None and "connection refused" in done.skipped
    assert (tmp_path / "ns-gone").is_dir()
    assert "nothing removed, next round retries" in caplog.text


def test_the_loop_survives_an_api_error_and_reclaims_in_the_next_round(tmp_path: Path) -> None:
    make_tier(tmp_path / "ns-gone")
    stop = threading.Event()
    calls: list[int] = []

    def flaky() -> dict[str, str]:
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError("the API server timed out")
        stop.set()
        return {}

    thread = threading.Thread(target=node_reclaim.run, args=([tmp_path], 0.05, flaky, stop))
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(calls) == 2
    assert os.listdir(tmp_path) == []


def test_a_directory_left_aside_by_an_interrupted_round_is_removed(tmp_path: Path) -> None:
    aside = reclaim_decisions.aside_name("gone")
    make_tier(tmp_path / aside)
    done = node_reclaim.reclaim_round(tmp_path, lambda: {})
    assert aside in done.removed
    assert os.listdir(tmp_path) == []


def test_the_program_without_an_api_removes_nothing_and_exits_cleanly(tmp_path: Path) -> None:
    make_tier(tmp_path / "ns-gone")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    result = subprocess.run(
        [sys.executable, "-m", "shardcache_operator.node_reclaim", str(tmp_path), "--once"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "could not list namespaces" in result.stderr
    assert (tmp_path / "ns-gone").is_dir()


def test_every_node_path_is_reclaimed_on_its_own_in_one_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three node paths, as the chart mounts `policy.nodePaths`: the same deleted
    namespace's tier in each, one of them leased by a live process, one path gone."""
    held, free, gone = tmp_path / "held", tmp_path / "free", tmp_path / "gone"
    make_tier(held / f"ns-gone.{EARLIER}")
    data = make_tier(free / f"ns-gone.{EARLIER}")
    make_tier(free / f"ns-live.{LIVE}")
    calls: list[int] = []

    def namespaces() -> dict[str, str]:
        calls.append(1)
        return {"live": LIVE}

    with (
        holder(held / f"ns-gone.{EARLIER}", "lease"),
        caplog.at_level(logging.INFO, logger=node_reclaim.__name__),
    ):
        rounds = node_reclaim.reclaim_paths([held, gone, free], namespaces)
    assert calls == [1]
    assert rounds[held].kept == {f"ns-gone.{EARLIER}": f"a process holds {KEY}.lock"}
    assert os.listdir(held) == [f"ns-gone.{EARLIER}"], "nothing renamed aside"
    assert rounds[gone].skipped == "it does not exist"
    assert f"node path {gone} skipped this round: it does not exist" in caplog.text
    assert rounds[free].removed[f"ns-gone.{EARLIER}"] >= data
    assert os.listdir(free) == [f"ns-live.{LIVE}"]
    rounds = node_reclaim.reclaim_paths([held, gone, free], namespaces)
    assert f"ns-gone.{EARLIER}" in rounds[held].removed
    assert os.listdir(held) == []


def test_the_program_takes_several_node_paths_and_without_an_api_removes_nothing(
    tmp_path: Path,
) -> None:
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        make_tier(root / "ns-gone")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    result = subprocess.run(
        [sys.executable, "-m", "shardcache_operator.node_reclaim", *map(str, roots), "--once"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("could not list namespaces") == 1, result.stderr
    assert all((root / "ns-gone").is_dir() for root in roots)


def test_a_node_path_given_twice_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardcache_operator.node_reclaim", str(tmp_path),
         f"{tmp_path}/", "--once"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"DIR '{tmp_path}/' names the node path '{tmp_path}' again" in result.stderr


def test_a_bad_interval_is_refused_with_what_was_found(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardcache_operator.node_reclaim", str(tmp_path),
         "--interval-seconds", "0"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--interval-seconds must be > 0, found 0.0" in result.stderr


def test_sigterm_stops_the_program_between_rounds_at_once(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardcache_operator.node_reclaim", str(tmp_path),
         "--interval-seconds", "3600"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    with proc.stderr:
        # The first round (which fails without an API) is logged; then it waits.
        assert "could not list namespaces" in proc.stderr.readline()
        proc.terminate()
        assert proc.wait(timeout=10) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files of the kubelet (root) and the sidecar")
def test_the_sidecars_user_removes_a_kubelet_made_tier_as_on_a_node() -> None:
    """The layout on a node: the node path the sidecar's (2770, prepared by the
    DaemonSet), `ns-<namespace>` made by the kubelet for a subPath (root's, the sidecar's
    group, 2770), entries the sidecar's; the reclaim runs as the sidecar's user alone."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    uid = 65532
    # pytest's tmp_path is below a directory only root may enter.
    with tempfile.TemporaryDirectory(prefix="node-reclaim-") as where:
        Path(where).chmod(0o755)
        reclaim_as_the_sidecar(setpriv, uid, Path(where) / "node")


def reclaim_as_the_sidecar(setpriv: str, uid: int, root: Path) -> None:
    root.mkdir()
    os.chown(root, uid, uid)
    root.chmod(0o2770)
    (root / "ns-gone").mkdir()
    os.chown(root / "ns-gone", 0, uid)
    (root / "ns-gone").chmod(0o2770)
    as_sidecar = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable]
    make = (
        "from pathlib import Path\nfrom tests.integration.test_node_reclaim import make_tier\n"
        f"make_tier(Path({str(root / 'ns-gone')!r}))\n"
    )
    subprocess.run([*as_sidecar, "-c", make], check=True, timeout=120, cwd=os.getcwd())
    reclaim = (
        "from pathlib import Path\nfrom shardcache_operator import node_reclaim\n"
        f"print(node_reclaim.reclaim_round(Path({str(root)!r}), lambda: {{}}).removed)\n"
    )
    result = subprocess.run(
        [*as_sidecar, "-c", reclaim], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "'ns-gone'" in result.stdout, result.stderr
    assert os.listdir(root) == []


def test_a_round_that_fails_unexpectedly_is_said_and_the_loop_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    make_tier(tmp_path / "ns-gone")
    stop = threading.Event()
    decide = reclaim_decisions.decide
    calls: list[int] = []

    def broken_once(names: list[str], namespaces: dict[str, str]) -> reclaim_decisions.Decision:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        stop.set()
        return decide(names, namespaces)

    monkeypatch.setattr(reclaim_decisions, "decide", broken_once)
    thread = threading.Thread(target=node_reclaim.run, args=([tmp_path], 0.05, lambda: {}, stop))
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "the round failed; the next round retries" in caplog.text
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("name", "aside"), [("../x", ".a"), ("ns-a", "../b"), ("", ".a")])
def test_names_that_would_leave_the_node_path_are_refused(
    tmp_path: Path, name: str, aside: str
) -> None:
    with pytest.raises(errors.InputError, match="must be one path component, found"):
        tiers.move_aside_unused(tmp_path, name, aside)
