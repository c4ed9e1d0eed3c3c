"""A tiny OCI image writer: files -> one tar layer -> an OCI image layout archive.

An OCI image is JSON and blobs named by their sha256: a config (entrypoint, user,
rootfs diff ids), a manifest (config + layers), an index naming the manifest, and the
`oci-layout` marker, all in one tar. That is what `ctr images import` reads, and it needs
the image's name in the index as the `io.containerd.image.name` annotation.

Everything is deterministic (sorted entries, mtime 0, owner root): the same files give
the same digests, so an archive can be cached by what it was built from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pathlib
import tarfile
from collections.abc import Mapping, Sequence

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
#: What containerd reads as the image's name when it imports an OCI archive.
NAME_ANNOTATION = "io.containerd.image.name"
REF_ANNOTATION = "org.opencontainers.image.ref.name"


@dataclasses.dataclass(frozen=True)
class File:
    """One regular file of a layer: its path inside the image, bytes and mode."""

    path: str
    data: bytes
    mode: int = 0o644


@dataclasses.dataclass(frozen=True)
class Config:
    """The parts of an image config these images use."""

    entrypoint: Sequence[str]
    cmd: Sequence[str] = ()
    env: Sequence[str] = ("PATH=/",)
    # Images run as non-root unless a pod says otherwise (the pause image's own choice).
    user: str = "65532:65532"
    workdir: str = "/"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer(files: Sequence[File], *, dirs: Sequence[str] = ()) -> bytes:
    """An uncompressed tar layer holding `files` and empty `dirs` (parents implied)."""
    entries: dict[str, tarfile.TarInfo] = {}
    payload: dict[str, bytes] = {}

    def add_dir(path: str) -> None:
        parts = pathlib.PurePosixPath(path.strip("/")).parts
        for i in range(1, len(parts) + 1):
            name = "/".join(parts[:i])
            if name not in entries:
                info = tarfile.TarInfo(name)
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                entries[name] = info

    for d in dirs:
        add_dir(d)
    for f in files:
        name = f.path.strip("/")
        parent = str(pathlib.PurePosixPath(name).parent)
        if parent != ".":
            add_dir(parent)
        info = tarfile.TarInfo(name)
        info.size = len(f.data)
        info.mode = f.mode
        entries[name] = info
        payload[name] = f.data
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(entries):
            info = entries[name]
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            data = payload.get(name)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _json(doc: Mapping[str, object]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def image_archive(name: str, layers: Sequence[bytes], config: Config) -> bytes:
    """An OCI layout tar of one linux/amd64 image called `name` (`repo:tag`)."""
    if ":" not in name.rsplit("/", 1)[-1]:
        raise ValueError(f"image name {name!r} needs a tag (repo:tag)")
    config_doc = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": list(config.entrypoint),
            "Cmd": list(config.cmd),
            "Env": list(config.env),
            "User": config.user,
            "WorkingDir": config.workdir,
        },
        "rootfs": {"type": "layers", "diff_ids": [sha256(blob) for blob in layers]},
    }
    config_blob = _json(config_doc)
    manifest_blob = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {
                "mediaType": MEDIA_CONFIG,
                "digest": sha256(config_blob),
                "size": len(config_blob),
            },
            "layers": [
                {"mediaType": MEDIA_LAYER, "digest": sha256(blob), "size": len(blob)}
                for blob in layers
            ],
        }
    )
    index_blob = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": sha256(manifest_blob),
                    "size": len(manifest_blob),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        NAME_ANNOTATION: name,
                        REF_ANNOTATION: name.rsplit(":", 1)[1],
                    },
                }
            ],
        }
    )
    files = [
        File("oci-layout", _json({"imageLayoutVersion": "1.0.0"})),
        File("index.json", index_blob),
    ]
    for blob in (config_blob, manifest_blob, *layers):
        files.append(File("blobs/sha256/" + sha256(blob).removeprefix("sha256:"), blob))
    unique = {f.path: f for f in files}  # two equal layers are one blob
    return layer(list(unique.values()))


def read_index(archive: pathlib.Path) -> dict[str, object]:
    """The index.json of an OCI layout archive (to find the names it carries)."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            raise ValueError(f"{archive}: index.json is not a file")
        doc = json.loads(member.read())
    if not isinstance(doc, dict):
        raise ValueError(f"{archive}: index.json is not an object")
    return doc


def image_names(archive: pathlib.Path) -> list[str]:
    """The `io.containerd.image.name` of each manifest in the archive's index."""
    manifests = read_index(archive).get("manifests") or []
    assert isinstance(manifests, list)
    names = []
    for m in manifests:
        name = (m.get("annotations") or {}).get(NAME_ANNOTATION)
        if name:
            names.append(str(name))
    return names
