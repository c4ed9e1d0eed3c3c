"""The node-cache DaemonSet's reclaim over several node paths (`node_reclaim.reclaim_paths`,
one per `policy.nodePaths` entry): one namespace list a round for all of them; each
path's removals, tier locks, leftovers and refusals its own; one that cannot be listed
(missing, a file, a link) skipped with a WARNING naming it while the others are
reclaimed; and the command line that takes them (one directory, as older charts gave,
still works; bad arguments are refused saying what was found)."""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from shardcache_operator import node_reclaim, reclaim_decisions

pytestmark = pytest.mark.unit

GONE = "11111111-2222-4333-8444-555555555555"
LIVE = "66666666-7777-4888-9999-aaaaaaaaaaaa"
LIVE_NAMESPACES = {"live": LIVE}


def node_path(where: Path) -> Path:
    """A node path holding a deleted namespace's directory and a live one's."""
    where.mkdir()
    for name in (f"ns-gone.{GONE}", f"ns-live.{LIVE}"):
        (where / name).mkdir()
        (where / name / "entry").write_bytes(b"x" * 10)
    return where


class Lister:
    """A namespace list that counts its calls."""

    def __init__(self, namespaces: dict[str, str]) -> None:
        self.namespaces = namespaces
        self.calls = 0

    def __call__(self) -> dict[str, str]:
        self.calls += 1
        return self.namespaces


def test_one_namespace_list_serves_every_node_path(tmp_path: Path) -> None:
    roots = [node_path(tmp_path / "a"), node_path(tmp_path / "b"), node_path(tmp_path / "c")]
    lister = Lister(LIVE_NAMESPACES)
    rounds = node_reclaim.reclaim_paths(roots, lister)
    assert lister.calls == 1
    assert list(rounds) == roots
    for root in roots:
        assert rounds[root].removed == {f"ns-gone.{GONE}": 10}
        assert os.listdir(root) == [f"ns-live.{LIVE}"]


def link_to_a_node_path(where: Path) -> Path:
    node_path(where.with_name("elsewhere"))
    where.symlink_to(where.with_name("elsewhere"))
    return where


def a_file(where: Path) -> Path:
    where.write_text("not a node path")
    return where


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: p, "it does not exist"),
        (a_file, "it is a regular file, not a directory"),
        (link_to_a_node_path, "it is a symbolic link, not a directory"),
    ],
    ids=["missing", "file", "link"],
)
def test_a_node_path_that_cannot_be_listed_is_said_and_the_others_are_reclaimed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make: Callable[[Path], Path], why: str
) -> None:
    first, last = node_path(tmp_path / "first"), node_path(tmp_path / "last")
    bad = make(tmp_path / "bad")
    with caplog.at_level(logging.INFO, logger=node_reclaim.__name__):
        rounds = node_reclaim.reclaim_paths([first, bad, last], lambda: LIVE_NAMESPACES)
    assert rounds[bad] == node_reclaim.Round(skipped=why)
    for root in (first, last):
        assert list(rounds[root].removed) == [f"ns-gone.{GONE}"]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == (
        f"node cache reclaim: node path {bad} skipped this round: {why}; the other node"
        " paths go on, the next round tries it again"
    )
    if bad.is_symlink():  # never followed: what it points at is kept whole
        assert sorted(os.listdir(bad.resolve())) == [f"ns-gone.{GONE}", f"ns-live.{LIVE}"]


def test_a_node_path_that_cannot_be_read_is_said_with_what_the_system_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory this process may not read (unreadable to its user; root reads it
    anyway, so the refusal is the system's answer, given here)."""
    unreadable, readable = node_path(tmp_path / "unreadable"), node_path(tmp_path / "readable")
    listed = node_reclaim.list_node_path

    def refusing(root: Path) -> list[str]:
        if root == unreadable:
            raise PermissionError(13, "Permission denied", str(root))
        return listed(root)

    monkeypatch.setattr(node_reclaim, "list_node_path", refusing)
    rounds = node_reclaim.reclaim_paths([unreadable, readable], lambda: LIVE_NAMESPACES)
    why = f"it could not be listed ([Errno 13] Permission denied: '{unreadable}')"
    assert rounds[unreadable] == node_reclaim.Round(skipped=why)
    assert f"node path {unreadable} skipped this round: {why}" in caplog.text
    assert list(rounds[readable].removed) == [f"ns-gone.{GONE}"]


@pytest.fixture
def tier_lock_held(tmp_path: Path) -> Iterator[Path]:
    """Node path `a` whose deleted namespace's tier lock another holder has."""
    root = node_path(tmp_path / "a")
    lock = root / f"ns-gone.{GONE}" / ".tier.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield root
    finally:
        os.close(fd)


def test_each_node_paths_locks_and_leftovers_are_its_own(
    tmp_path: Path, tier_lock_held: Path
) -> None:
    """The same directory name in two node paths: held in one, free in the other; a
    leftover of an interrupted round in the second alone."""
    held, free = tier_lock_held, node_path(tmp_path / "b")
    leftover = reclaim_decisions.aside_name("earlier")
    (free / leftover).mkdir()
    (free / leftover / "entry").write_bytes(b"y" * 7)
    rounds = node_reclaim.reclaim_paths([held, free], lambda: LIVE_NAMESPACES)
    assert rounds[held].kept == {f"ns-gone.{GONE}": "its tier lock is held"}
    assert not rounds[held].removed
    assert sorted(os.listdir(held)) == [f"ns-gone.{GONE}", f"ns-live.{LIVE}"]
    assert rounds[free].removed == {leftover: 7, f"ns-gone.{GONE}": 10}
    assert os.listdir(free) == [f"ns-live.{LIVE}"]


def test_a_refused_name_is_warned_about_once_in_each_node_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    roots = [node_path(tmp_path / "a"), node_path(tmp_path / "b")]
    for root in roots:
        (root / "ns-Not_A_Namespace").mkdir()
    said: dict[Path, set[str]] = {}
    with caplog.at_level(logging.WARNING, logger=node_reclaim.__name__):
        for _ in range(2):
            node_reclaim.reclaim_paths(roots, lambda: LIVE_NAMESPACES, said=said)
    warned = [r.getMessage() for r in caplog.records]
    assert [line.split(" left alone")[0] for line in warned] == [
        f"node cache reclaim: {root / 'ns-Not_A_Namespace'}" for root in roots
    ]
    for root in roots:
        assert (root / "ns-Not_A_Namespace").is_dir()


def test_a_failed_namespace_list_removes_nothing_in_any_node_path_and_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    roots = [node_path(tmp_path / "a"), node_path(tmp_path / "b")]

    def failing() -> dict[str, str]:
        raise ConnectionRefusedError("connection refused")

    rounds = node_reclaim.reclaim_paths(roots, failing)
    why = "could not list namespaces (ConnectionRefusedError: connection refused)"
    assert rounds == {root: node_reclaim.Round(skipped=why) for root in roots}
    assert len(caplog.records) == 1
    for root in roots:
        assert (root / f"ns-gone.{GONE}").is_dir()


def test_a_round_that_fails_unexpectedly_in_one_node_path_leaves_the_others_theirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = node_path(tmp_path / "a"), node_path(tmp_path / "b")
    decide = reclaim_decisions.decide

    def broken_in_the_first(
        names: list[str], namespaces: dict[str, str]
    ) -> reclaim_decisions.Decision:
        if "broken" in names:
            raise RuntimeError("a bug")
        return decide(names, namespaces)

    (first / "broken").mkdir()
    monkeypatch.setattr(reclaim_decisions, "decide", broken_in_the_first)
    rounds = node_reclaim.reclaim_paths([first, second], lambda: LIVE_NAMESPACES)
    assert rounds[first].skipped == "the round failed (RuntimeError: a bug)"
    assert f"node path {first}: the round failed; the next round retries" in caplog.text
    assert list(rounds[second].removed) == [f"ns-gone.{GONE}"]


def test_one_directory_as_older_charts_give_it_is_still_taken(tmp_path: Path) -> None:
    args = node_reclaim.parse(["/node-cache", "--interval-seconds=600"])
    assert (args.roots, args.interval_seconds) == ([Path("/node-cache")], 600.0)
    root = node_path(tmp_path / "a")
    done = node_reclaim.reclaim_round(root, lambda: LIVE_NAMESPACES)
    assert list(done.removed) == [f"ns-gone.{GONE}"]


def test_several_directories_are_taken_in_their_order() -> None:
    args = node_reclaim.parse(["/node-cache", "/node-cache-2", "/node-cache-1", "--once"])
    assert args.roots == [Path("/node-cache"), Path("/node-cache-2"), Path("/node-cache-1")]
    assert args.once


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([], "the following arguments are required: DIR"),
        (
            ["/node-cache", "/node-cache/"],
            "DIR '/node-cache/' names the node path '/node-cache' again",
        ),
        (["/a", "/b/../a"], "DIR '/b/../a' names the node path '/a' again"),
        (["/a", ""], "DIR must be a node path, found an empty argument"),
        (
            ["/a", "/b", "--node-path=/var/x"],
            "--node-path: expected one per DIR (2: /a /b), found 1: /var/x",
        ),
    ],
    ids=["none", "twice", "twice-dotted", "empty", "node-paths-short"],
)
def test_bad_directories_are_refused_saying_what_was_found(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        node_reclaim.parse(argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_the_program_reclaims_every_directory_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = [node_path(tmp_path / "a"), node_path(tmp_path / "b")]
    lister = Lister(LIVE_NAMESPACES)
    monkeypatch.setattr(node_reclaim, "kubernetes_lister", lambda: lister)
    assert node_reclaim.main([*map(str, roots), str(tmp_path / "missing"), "--once"]) == 0
    assert lister.calls == 1
    for root in roots:
        assert os.listdir(root) == [f"ns-live.{LIVE}"]


def test_the_logs_name_the_node_path_each_directory_is_mounted_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The container sees /node-cache-1; the node's admin knows the host path.
    roots = [node_path(tmp_path / "a"), node_path(tmp_path / "b")]
    (roots[1] / "ns-bad name").mkdir()
    monkeypatch.setattr(node_reclaim, "kubernetes_lister", lambda: Lister(LIVE_NAMESPACES))
    argv = [*map(str, roots), "--node-path=/var/cache/x", "--node-path=/mnt/y", "--once"]
    with caplog.at_level(logging.INFO, logger=node_reclaim.__name__):
        assert node_reclaim.main(argv) == 0
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert f"removed /var/cache/x/{reclaim_decisions.ASIDE_PREFIX}gone-" in said
    assert f"removed /mnt/y/{reclaim_decisions.ASIDE_PREFIX}gone-" in said
    assert "/mnt/y/ns-bad name left alone" in said
    assert str(tmp_path) not in said, "no log names the mount point"


def test_without_node_paths_the_logs_name_the_directories_as_given(tmp_path: Path) -> None:
    roots = [node_path(tmp_path / "a")]
    assert node_reclaim.node_paths(roots, []) == {roots[0]: roots[0]}
