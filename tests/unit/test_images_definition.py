"""The image definition, its Dockerfile, the apt sources it reads and the OCI writer."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from images import definition, inputs, oci, rootfs

pytestmark = pytest.mark.unit

MINIMAL = """
[base]
suite = "bookworm"
packages = ["python3-minimal"]
user = 65532
group = 65532
workdir = "/"
[base.env]
PYTHONDONTWRITEBYTECODE = "1"
[images.svc]
name = "localhost/svc"
extras = ["sidecar"]
entrypoint = ["shardcache"]
cmd = ["--help"]
ports = [8080]
"""


def test_committed_definition_has_the_service_and_trainer_images() -> None:
    defn = definition.load()
    assert set(defn.images) == {"shardcache", "trainer"}
    assert defn.images["shardcache"].requirement == "shardcache[operator,sidecar]"
    assert defn.images["trainer"].requirement == "shardcache"
    assert (defn.base.user, defn.base.group) == (65532, 65532)
    for image in defn.images.values():
        for src in image.files:
            assert (definition.IMAGES_DIR / src).is_file(), src


def test_dockerfile_carries_the_definitions_config() -> None:
    defn = definition.parse(MINIMAL)
    text = definition.dockerfile(defn.base, defn.images["svc"])
    assert text.splitlines()[1:] == [
        "FROM scratch",
        "ADD rootfs.tar /",
        'ENV PYTHONDONTWRITEBYTECODE="1"',
        "USER 65532:65532",
        "WORKDIR /",
        "EXPOSE 8080",
        'ENTRYPOINT ["shardcache"]',
        'CMD ["--help"]',
    ]


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (MINIMAL.replace("user = 65532", 'user = "nonroot"'), "base.user must be an integer"),
        (MINIMAL.replace('entrypoint = ["shardcache"]', ""), "entrypoint must be a list"),
        (MINIMAL.split("[images.svc]")[0], "no [images.*] table"),
        (MINIMAL + '[images.svc.files]\n"a.py" = "relative"\n', "absolute path"),
    ],
)
def test_malformed_definition_names_the_field(broken: str, message: str) -> None:
    with pytest.raises(definition.DefinitionError, match=message.replace("[", r"\[")):
        definition.parse(broken)


def test_apt_sources_keep_only_the_suite_family(tmp_path: Path) -> None:
    (tmp_path / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian\n"
        "Suites: bookworm bookworm-updates trixie\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/k.gpg\n\n"
        "Types: deb-src\nURIs: http://mirror.invalid/debian\nSuites: bookworm\n"
        "Components: main\n\n"
        "Enabled: no\nTypes: deb\nURIs: http://off.invalid\nSuites: bookworm\n"
    )
    (tmp_path / "other.list").write_text(
        "deb http://vendor.invalid/apt cloud-sdk-bookworm main\n"
        "# deb http://commented.invalid bookworm main\n"
        "deb [arch=amd64] http://sec.invalid/debian-security bookworm-security main\n"
    )
    (tmp_path / "old.list.disabled").write_text("deb http://disabled.invalid bookworm main\n")
    assert rootfs.apt_sources("bookworm", [tmp_path]) == [
        "deb [signed-by=/usr/share/keyrings/k.gpg] http://mirror.invalid/debian bookworm main",
        "deb [signed-by=/usr/share/keyrings/k.gpg] http://mirror.invalid/debian "
        "bookworm-updates main",
        "deb [arch=amd64] http://sec.invalid/debian-security bookworm-security main",
    ]


def test_no_apt_source_for_the_suite_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "x.list").write_text("deb http://mirror.invalid/debian trixie main\n")
    with pytest.raises(rootfs.BuildError, match="no apt source for Debian bookworm"):
        rootfs.apt_sources("bookworm", [tmp_path])


def _layer(path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        data = b"hello\n"
        info = tarfile.TarInfo("etc/hello")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_oci_archive_is_content_addressed_and_names_each_tag(tmp_path: Path) -> None:
    layer = _layer(tmp_path / "layer.tar")
    digest = oci.file_digest(layer)
    config = oci.image_config(
        diff_id=digest, user="65532:65532", env=["A=1"], entrypoint=["x"], cmd=[], workdir="/"
    )
    names = ["localhost/x:1.0-abc", "localhost/x:1.0"]
    manifest = oci.write_archive(layer=layer, config=config, names=names, out=tmp_path / "x.tar")
    with tarfile.open(tmp_path / "x.tar") as tar:
        blobs = {
            m.name.removeprefix("blobs/sha256/"): tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.name.startswith("blobs/")
        }
        layout = json.load(tar.extractfile("oci-layout"))  # type: ignore[arg-type]
    assert layout == {"imageLayoutVersion": "1.0.0"}
    # Every blob is stored under its own sha256.
    assert all(hashlib.sha256(data).hexdigest() == name for name, data in blobs.items())
    index = oci.read_index(tmp_path / "x.tar")
    assert [m["digest"] for m in index["manifests"]] == [manifest.digest] * 2
    assert [m["annotations"][oci.ANNOTATION_CONTAINERD_NAME] for m in index["manifests"]] == names
    assert oci.read_manifest(tmp_path / "x.tar")["layers"][0]["digest"] == digest
    oci.extract_layer(tmp_path / "x.tar", tmp_path / "rootfs.tar")
    assert (tmp_path / "rootfs.tar").read_bytes() == layer.read_bytes()


def test_config_that_does_not_name_the_layer_is_refused(tmp_path: Path) -> None:
    layer = _layer(tmp_path / "layer.tar")
    config = oci.image_config(
        diff_id="sha256:" + "0" * 64, user="0", env=[], entrypoint=["x"], cmd=[], workdir="/"
    )
    with pytest.raises(ValueError, match="do not name the layer"):
        oci.write_archive(layer=layer, config=config, names=["a:b"], out=tmp_path / "x.tar")
    assert not (tmp_path / "x.tar").exists()


def _fake_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(
        definition.IMAGES_DIR, repo / "images", ignore=shutil.ignore_patterns("__pycache__")
    )
    for rel in inputs.PROJECT_FILES:
        (repo / rel).write_text(rel)
    for d in inputs.PROJECT_DIRS:
        (repo / d).mkdir(parents=True)
        (repo / d / "__init__.py").write_text("")
    return repo


def test_content_key_changes_with_any_input_and_only_then(tmp_path: Path) -> None:
    repo = _fake_repo(tmp_path)
    args = {"suite_sources": ["deb http://m.invalid/debian bookworm main"], "packages": ["a"]}

    def key(**overrides: list[str]) -> str:
        return inputs.content_key(repo=repo, **{**args, **overrides})

    first = key()
    # Caches and bytecode are not inputs.
    (repo / "shardcache" / "__pycache__").mkdir()
    (repo / "shardcache" / "__pycache__" / "x.pyc").write_bytes(b"x")
    (repo / "images" / "NOTES.md").write_text("docs are not inputs")
    assert key() == first
    assert key(packages=["a", "b"]) != first
    assert key(suite_sources=["deb http://other.invalid/debian bookworm main"]) != first
    (repo / "images" / "requirements.lock").write_text("pyarrow==1 --hash=sha256:00\n")
    second = key()
    assert second != first
    (repo / "shardcache" / "new.py").write_text("")
    assert key() != second
