"""The node tier's own images, and importing any OCI archive into the node's containerd.

Nothing is ever pulled: every image a pod on the real node uses is built here or by the
project's image build, as an OCI archive, and imported with `ctr -n k8s.io images
import` into the cluster's own containerd (never the machine's default socket).

  pause    the sandbox image: Kubernetes' own build/pause/linux/pause.c from the pinned
           k8s.io/kubernetes module, `gcc -static`
  toolbox  tests/cluster/toolbox.c, `gcc -static`: the node tier's test containers

Names use the reserved `.test` domain (RFC 2606) so they can never mean a registry, and
tags are content hashes: an archive is rebuilt only when its source, the compiler or this
writer changes, and is cached under $TOOLS_CACHE/images/.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import subprocess
import tempfile

from tests.cluster import oci

HERE = pathlib.Path(__file__).resolve().parent
#: Bump when the archive layout written here changes, so cached archives are rebuilt.
WRITER_VERSION = "1"
IMAGE_DOMAIN = "shardcache.test"
NAMESPACE = "k8s.io"  # the containerd namespace the CRI plugin (so the kubelet) uses


@dataclasses.dataclass(frozen=True)
class Image:
    name: str  # repo:tag, what a pod's `image:` says
    archive: pathlib.Path


def tools_cache() -> pathlib.Path:
    return pathlib.Path(
        os.environ.get("TOOLS_CACHE") or pathlib.Path.home() / ".cache" / "shardcache-tools"
    )


def _gomodcache() -> pathlib.Path:
    out = subprocess.run(
        ["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True
    ).stdout
    return pathlib.Path(out.strip())


def pause_source(kube_version: str) -> pathlib.Path:
    source = _gomodcache() / f"k8s.io/kubernetes@{kube_version}" / "build/pause/linux/pause.c"
    if not source.is_file():
        # The module is in the cache once `make tools` built the control plane from it.
        subprocess.run(
            ["go", "mod", "download", f"k8s.io/kubernetes@{kube_version}"],
            cwd="/",
            check=True,
            env={**os.environ, "GOWORK": "off", "GOTOOLCHAIN": "local"},
        )
    return source


def _compiler_id() -> str:
    return subprocess.run(
        ["gcc", "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]


def static_binary_image(
    repo: str, source: pathlib.Path, *, binary: str, cflags: tuple[str, ...] = ()
) -> Image:
    """An image holding one static binary compiled from `source`, cached by content."""
    key = hashlib.sha256(
        json.dumps([WRITER_VERSION, _compiler_id(), list(cflags), source.read_text()]).encode()
    ).hexdigest()[:16]
    name = f"{IMAGE_DOMAIN}/{repo}:{key}"
    archive = tools_cache() / "images" / f"{repo}-{key}.tar"
    if archive.is_file():
        return Image(name, archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / binary
        subprocess.run(
            ["gcc", "-Os", "-Wall", "-Werror", "-static", *cflags, "-o", str(out), str(source)],
            check=True,
        )
        subprocess.run(["strip", str(out)], check=True)
        blob = oci.image_archive(
            name,
            [oci.layer([oci.File(binary, out.read_bytes(), 0o755)], dirs=("tmp",))],
            oci.Config(entrypoint=(f"/{binary}",), user="65532:65532"),
        )
    partial = archive.with_suffix(".partial")
    partial.write_bytes(blob)
    partial.rename(archive)
    return Image(name, archive)


def pause_image(kube_version: str) -> Image:
    # The release's own flags (build/pause/Makefile) but for VERSION, which it takes from
    # its git tag; the kubernetes module version says where the source came from.
    return static_binary_image(
        "pause",
        pause_source(kube_version),
        binary="pause",
        cflags=(f"-DVERSION={kube_version}-shardcache",),
    )


def toolbox_image() -> Image:
    return static_binary_image("toolbox", HERE / "toolbox.c", binary="toolbox")


def import_image(archive: pathlib.Path, *, address: pathlib.Path) -> list[str]:
    """Import an OCI archive into the containerd at `address`; returns the names imported.

    The archive must name its image(s) with the `io.containerd.image.name` annotation in
    its index (oci.image_archive does; `umoci` tags cannot hold a `/`).
    """
    names = oci.image_names(archive)
    if not names:
        raise SystemExit(
            f"import-image: {archive} names no image: its index.json needs the "
            f"{oci.NAME_ANNOTATION!r} annotation (repo:tag) on each manifest"
        )
    result = subprocess.run(
        [
            "ctr",
            "--address",
            str(address),
            "--namespace",
            NAMESPACE,
            "images",
            "import",
            str(archive),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(
            f"import-image: ctr could not import {archive} ({result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )
    return names


def image_present(name: str, *, address: pathlib.Path) -> bool:
    listing = subprocess.run(
        ["ctr", "--address", str(address), "--namespace", NAMESPACE, "images", "ls", "-q"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return name in listing
