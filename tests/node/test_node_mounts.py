"""The node's own mounts, made and removed on the host (root only, as the whole tier):
the kubelet's root is a shared mount before the kubelet starts, and a down removes
mounts stacked on one point."""

from __future__ import annotations

import pathlib
import subprocess
from collections.abc import Iterator

import pytest

from tests.cluster import node

pytestmark = pytest.mark.node


def entries(point: pathlib.Path) -> list[list[str]]:
    """/proc/self/mountinfo's lines for mounts at exactly `point`, split."""
    at = str(point.resolve())
    lines = pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
    return [line.split() for line in lines if line.split()[4] == at]


@pytest.fixture
def paths(tmp_path: pathlib.Path) -> Iterator[node.Paths]:
    made = node.Paths.under(tmp_path)
    made.kubelet_root.mkdir(parents=True)
    yield made
    node.unmount_under(made.root)


def test_the_kubelets_root_is_one_shared_mount_however_often_it_is_shared(
    paths: node.Paths,
) -> None:
    node.share_kubelet_root(paths)
    node.share_kubelet_root(paths)
    found = entries(paths.kubelet_root)
    assert len(found) == 1, found
    # Optional fields sit between the mount options (index 5) and the "-" separator;
    # "shared:N" is what the kubelet's MakeRShared looks for before mounting its own.
    optional = found[0][6 : found[0].index("-")]
    assert any(field.startswith("shared:") for field in optional), found[0]


def test_unmount_under_removes_every_mount_stacked_on_one_point(paths: node.Paths) -> None:
    node.share_kubelet_root(paths)
    point = str(paths.kubelet_root.resolve())
    subprocess.run(["mount", "--bind", point, point], check=True)
    assert len(entries(paths.kubelet_root)) == 2
    assert node.unmount_under(paths.root) == []
    assert entries(paths.kubelet_root) == []
