"""The uninstall guard's decision (`shardcache_operator.uninstall_guard`): helm's
pre-delete hook exits 1, naming every DatasetMount that uninstalling would strand, and 0
only when the API says there is none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from shardcache_operator import uninstall_guard
from shardcache_operator.uninstall_guard import Held, ListFailed

pytestmark = pytest.mark.unit


def mount(namespace: str, name: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name}, "status": status}


def run(
    tmp_path: Path, by_namespace: dict[str, Any], *argv: str
) -> tuple[int, str, list[str], list[float]]:
    """main() over a lister answering from `by_namespace` ("" = every namespace): a list
    of objects, or an exception (a list of exceptions: one per call, then objects)."""
    asked: list[str] = []
    slept: list[float] = []

    def connect(kubeconfig: str | None) -> uninstall_guard.Lister:
        def listing(namespace: str) -> list[dict[str, Any]]:
            asked.append(namespace)
            answer = by_namespace.get(namespace, [])
            if isinstance(answer, Exception):
                raise answer
            if answer and isinstance(answer[0], Exception):
                raise answer.pop(0)
            return list(answer)

        return listing

    log = tmp_path / "termination-log"
    code = uninstall_guard.main(
        list(argv), termination_log=str(log), connect=connect, sleep=slept.append
    )
    return code, log.read_text() if log.exists() else "", asked, slept


def test_no_mount_lets_the_uninstall_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, said, asked, _ = run(tmp_path, {"": []})
    assert code == 0
    assert asked == [""]
    assert said == ""
    assert "no DatasetMount in any namespace" in capsys.readouterr().out


def test_mounts_refuse_the_uninstall_naming_each_and_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = [
        mount("team-b", "web", phase="Ready", attachedPods=3),
        {**mount("team-a", "imagenet", phase="Ready", attachedPods=1),
         "metadata": {"namespace": "team-a", "name": "imagenet",
                      "deletionTimestamp": "2026-11-28T20:00:00Z"}},
        mount("team-a", "fresh"),
    ]  # fmt: skip
    code, said, _, _ = run(
        tmp_path, {"": found}, "--release=sc", "--revision=4", "--release-namespace=sc-system"
    )
    assert code == 1
    out = capsys.readouterr().out
    assert said == out.rstrip("\n"), "the termination message is what stdout said"
    lines = said.splitlines()
    assert lines[0].startswith("helm uninstall refused: 3 DatasetMounts still exist, ")
    assert "shardcache.io/finalizer" in lines[0] and "Terminating" in lines[0]
    assert lines[1:4] == [
        "  team-a/fresh (no phase yet)",
        "  team-a/imagenet (being deleted, Ready, 1 attached pod)",
        "  team-b/web (Ready, 3 attached pods)",
    ]
    assert "kubectl delete datasetmounts --all -A --wait=false" in said
    assert "kubectl wait --for=delete datasetmounts --all -A --timeout=10m" in said
    assert "shardcache.io/force-delete=true does not wait" in said
    assert "helm uninstall --no-hooks" in said
    assert lines[-1] == (
        "helm now lists the release as uninstalling, though nothing was removed; to keep it "
        "instead: helm rollback sc 4 -n sc-system."
    )


def test_a_namespaced_release_lists_only_its_namespaces(tmp_path: Path) -> None:
    code, said, asked, _ = run(
        tmp_path,
        {"": [mount("other", "x")], "team-a": [], "team-b": [mount("team-b", "web")]},
        "--namespace=team-a", "--namespace=team-b", "--namespace=team-a",
    )  # fmt: skip
    assert code == 1
    assert asked == ["team-a", "team-b"], "each watched namespace once, never the cluster"
    assert "1 DatasetMount still exists in team-a, team-b," in said
    assert "other/x" not in said


def test_a_namespaced_release_suggests_deleting_in_its_namespaces_only(tmp_path: Path) -> None:
    # `--all -A` would delete the mounts of every release, not only this one's.
    held = {"team-a": [mount("team-a", "x")], "team-b": [mount("team-b", "web")], "team-c": []}
    code, said, _, _ = run(
        tmp_path, held, "--namespace=team-c", "--namespace=team-b", "--namespace=team-a"
    )
    assert code == 1
    commands = [line.strip() for line in said.splitlines() if line.startswith("  kubectl")]
    assert commands == [
        "kubectl delete datasetmounts --all -n team-a --wait=false",
        "kubectl delete datasetmounts --all -n team-b --wait=false",
        "kubectl wait --for=delete datasetmounts --all -n team-a --timeout=10m",
        "kubectl wait --for=delete datasetmounts --all -n team-b --timeout=10m",
    ], "one pair per namespace holding a mount, none for team-c, which holds none"
    assert " -A" not in said


def test_no_datasetmount_crd_means_no_mount(tmp_path: Path) -> None:
    code, said, _, _ = run(tmp_path, {"": LookupError("datasetmounts.shardcache.io")})
    assert code == 0
    assert said == ""


def test_a_list_that_keeps_failing_refuses_the_uninstall_saying_why(tmp_path: Path) -> None:
    failed = ListFailed("listing DatasetMounts in every namespace failed: HTTP 503 Unavailable")
    code, said, asked, slept = run(tmp_path, {"": failed})
    assert code == 1
    assert asked == [""] * uninstall_guard.ATTEMPTS
    assert slept == [uninstall_guard.RETRY_SECONDS] * (uninstall_guard.ATTEMPTS - 1)
    assert said.startswith("helm uninstall refused: the guard could not tell whether")
    assert "HTTP 503 Unavailable" in said and "--no-hooks" in said


def test_a_refused_list_is_not_tried_again(tmp_path: Path) -> None:
    forbidden = ListFailed(
        "listing DatasetMounts in every namespace failed: HTTP 403", lasting=True
    )
    code, said, asked, slept = run(tmp_path, {"": forbidden})
    assert (code, asked, slept) == (1, [""], [])
    assert "HTTP 403" in said


def test_a_list_that_fails_once_is_tried_again(tmp_path: Path) -> None:
    flaky = [ListFailed("connection refused"), mount("team-a", "web")]
    code, said, asked, slept = run(tmp_path, {"": flaky})
    assert (code, asked, slept) == (1, ["", ""], [uninstall_guard.RETRY_SECONDS])
    assert "  team-a/web (no phase yet)" in said


def test_a_long_list_names_the_first_and_counts_the_rest() -> None:
    held = [Held("ns", f"m{i:03d}", "Ready", False, None) for i in range(25)]
    text = uninstall_guard.refusal(held, [])
    assert text is not None
    named = [line for line in text.splitlines() if line.startswith("  ns/")]
    assert len(named) == uninstall_guard.NAMED
    assert "  ... and 5 more" in text


def test_the_refusal_is_none_only_for_no_mount() -> None:
    assert uninstall_guard.refusal([], ["team-a"]) is None
    one = uninstall_guard.refusal([Held("a", "b", "Pending", False, 0)], [])
    assert one is not None and one.startswith(
        "helm uninstall refused: 1 DatasetMount still exists,"
    )
    assert "  a/b (Pending)" in one
