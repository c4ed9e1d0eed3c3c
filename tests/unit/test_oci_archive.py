"""The node tier's OCI writer (tests/cluster/oci.py): what `ctr images import` reads."""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import tarfile

import pytest

from tests.cluster import oci

pytestmark = pytest.mark.unit


def members(blob: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        return {
            m.name: (tar.extractfile(m).read() if m.isfile() else b"")  # type: ignore[union-attr]
            for m in tar.getmembers()
        }


def test_same_files_give_byte_identical_archives() -> None:
    files = [oci.File("bin/tool", b"\x7fELF", 0o755), oci.File("etc/x", b"x")]
    config = oci.Config(entrypoint=("/bin/tool",))
    first = oci.image_archive("shardcache.test/tool:1", [oci.layer(files)], config)
    again = oci.image_archive("shardcache.test/tool:1", [oci.layer(list(reversed(files)))], config)
    assert first == again


def test_every_blob_is_named_by_its_sha256_and_the_index_names_the_image(
    tmp_path: pathlib.Path,
) -> None:
    layer = oci.layer([oci.File("toolbox", b"binary", 0o755)], dirs=("tmp",))
    archive = tmp_path / "image.tar"
    archive.write_bytes(
        oci.image_archive(
            "shardcache.test/toolbox:abc", [layer], oci.Config(entrypoint=("/toolbox",))
        )
    )
    content = members(archive.read_bytes())
    assert json.loads(content["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in content.items():
        if name.startswith("blobs/sha256/") and data:
            assert name.removeprefix("blobs/sha256/") == hashlib.sha256(data).hexdigest()

    assert oci.image_names(archive) == ["shardcache.test/toolbox:abc"]
    (entry,) = json.loads(content["index.json"])["manifests"]
    assert entry["annotations"][oci.REF_ANNOTATION] == "abc"
    manifest = json.loads(content["blobs/sha256/" + entry["digest"].removeprefix("sha256:")])
    config = json.loads(
        content["blobs/sha256/" + manifest["config"]["digest"].removeprefix("sha256:")]
    )
    assert config["rootfs"]["diff_ids"] == [oci.sha256(layer)]
    assert config["config"]["Entrypoint"] == ["/toolbox"]
    assert config["config"]["User"] == "65532:65532"
    assert (config["os"], config["architecture"]) == ("linux", "amd64")


def test_layer_holds_files_with_their_modes_owned_by_root_at_time_zero() -> None:
    blob = oci.layer([oci.File("a/b/tool", b"x", 0o755)])
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        infos = {m.name: m for m in tar.getmembers()}
    assert sorted(infos) == ["a", "a/b", "a/b/tool"]
    assert infos["a/b/tool"].mode == 0o755 and infos["a"].isdir()
    assert {(m.uid, m.gid, m.mtime) for m in infos.values()} == {(0, 0, 0)}


def test_a_name_without_a_tag_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a tag"):
        oci.image_archive("shardcache.test/tool", [], oci.Config(entrypoint=("/x",)))
