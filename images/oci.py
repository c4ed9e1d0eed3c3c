"""A small OCI image writer: one layer, a config, a manifest, an index, one archive.

An OCI image layout is JSON plus content-addressed blobs (image-spec v1.1:
image-layout.md, manifest.md, config.md); the archive is that layout as a tar, which
`ctr -n k8s.io images import`, `kind load image-archive`, `skopeo copy oci-archive:`
and `podman load` all read. containerd names the imported image from the
`io.containerd.image.name` annotation of each index entry (umoci's tags cannot hold
a `/`), so every name the image should have gets its own entry.

The layer is stored uncompressed: it is imported on the same machine, where
compressing ~300 MB costs more than it saves, and its size is then the image size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
ANNOTATION_CONTAINERD_NAME = "io.containerd.image.name"
ANNOTATION_REF_NAME = "org.opencontainers.image.ref.name"
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _json_bytes(data: Mapping[str, Any]) -> bytes:
    # Canonical enough to be stable: sorted keys, no whitespace.
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def image_config(
    *,
    diff_id: str,
    user: str,
    env: Sequence[str],
    entrypoint: Sequence[str],
    cmd: Sequence[str],
    workdir: str,
    ports: Sequence[int] = (),
    labels: Mapping[str, str] | None = None,
    created: float | None = None,
) -> dict[str, Any]:
    """The image config (image-spec config.md) of a single-layer linux/amd64 image."""
    stamp = time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(created if created is not None else time.time())
    )
    config: dict[str, Any] = {
        "User": user,
        "Env": list(env),
        "Entrypoint": list(entrypoint),
        "Cmd": list(cmd),
        "WorkingDir": workdir,
        "Labels": dict(labels or {}),
    }
    if ports:
        config["ExposedPorts"] = {f"{p}/tcp": {} for p in ports}
    return {
        "created": stamp,
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": stamp, "created_by": "images/build.py (images/image.toml)"}],
    }


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_archive(
    *,
    layer: Path,
    config: Mapping[str, Any],
    names: Sequence[str],
    out: Path,
) -> Descriptor:
    """Write the OCI archive `out` of one layer tar and its config, named `names`.

    `config`'s diff_ids must name `layer` (uncompressed, so its digest is its diff_id).
    Written to a temporary name and renamed, so `out` is whole or absent. Returns the
    manifest's descriptor (its digest is the image's id in containerd).
    """
    layer_desc = Descriptor(MEDIA_LAYER, file_digest(layer), layer.stat().st_size)
    if config["rootfs"]["diff_ids"] != [layer_desc.digest]:
        raise ValueError(
            f"config diff_ids {config['rootfs']['diff_ids']} do not name the layer "
            f"{layer_desc.digest}"
        )
    config_bytes = _json_bytes(config)
    config_desc = Descriptor(
        MEDIA_CONFIG, "sha256:" + hashlib.sha256(config_bytes).hexdigest(), len(config_bytes)
    )
    manifest_bytes = _json_bytes(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": config_desc.to_json(),
            "layers": [layer_desc.to_json()],
        }
    )
    manifest_desc = Descriptor(
        MEDIA_MANIFEST, "sha256:" + hashlib.sha256(manifest_bytes).hexdigest(), len(manifest_bytes)
    )
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                **manifest_desc.to_json(),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    ANNOTATION_CONTAINERD_NAME: name,
                    ANNOTATION_REF_NAME: name.rpartition(":")[2],
                },
            }
            for name in names
        ],
    }
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, "oci-layout", _json_bytes({"imageLayoutVersion": "1.0.0"}))
        _add_bytes(tar, "index.json", _json_bytes(index))
        _add_bytes(tar, f"blobs/sha256/{manifest_desc.digest[7:]}", manifest_bytes)
        _add_bytes(tar, f"blobs/sha256/{config_desc.digest[7:]}", config_bytes)
        info = tarfile.TarInfo(f"blobs/sha256/{layer_desc.digest[7:]}")
        info.size = layer_desc.size
        info.mode = 0o644
        with layer.open("rb") as f:
            tar.addfile(info, f)
    os.replace(tmp, out)
    return manifest_desc


def _member(tar: tarfile.TarFile, name: str, archive: Path) -> IO[bytes]:
    member = tar.extractfile(name)
    if member is None:
        raise ValueError(f"{archive}: {name} is missing")
    return member


def _blob(tar: tarfile.TarFile, digest: str, archive: Path) -> IO[bytes]:
    return _member(tar, f"blobs/sha256/{digest.removeprefix('sha256:')}", archive)


def read_index(archive: Path) -> dict[str, Any]:
    """index.json of an OCI archive (for checks and for listing the names it carries)."""
    with tarfile.open(archive) as tar:
        data: dict[str, Any] = json.load(_member(tar, "index.json", archive))
        return data


def read_manifest(archive: Path) -> dict[str, Any]:
    """The manifest of the archive's first (here: only) image."""
    with tarfile.open(archive) as tar:
        index = json.load(_member(tar, "index.json", archive))
        data: dict[str, Any] = json.load(_blob(tar, index["manifests"][0]["digest"], archive))
        return data


def extract_layer(archive: Path, dest: Path) -> None:
    """Copy the single layer of `archive` to `dest` (the rootfs tarball of the Dockerfile)."""
    (layer,) = read_manifest(archive)["layers"]
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(archive) as tar, _blob(tar, layer["digest"], archive) as src:
        with tmp.open("wb") as out:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
    os.replace(tmp, dest)
