"""Build the images of images/image.toml into OCI archives, cached by content key.

    python -m images.build                      # build if missing; print the archives
    python -m images.build --json               # the same, as JSON (for scripts)
    python -m images.build docker-context shardcache DIR   # rootfs.tar + Dockerfile
    python -m images.build lock                 # re-pin images/requirements.lock

`archives()` is the API the tests call. Archives live outside the repository, in
`$TOOLS_CACHE/images/<key>/` (default ~/.cache/shardcache-tools), where `<key>` is the
content key of images/inputs.py: unchanged inputs find the archives there and build
nothing. A build takes a lock, so two test sessions never build the same key twice.

Steps of a build (images/README.md has the why):
1. the wheels: the pinned dependencies (`pip wheel --require-hashes -r
   requirements.lock`) and the project's own wheel, built from a copy of its sources;
2. one Debian rootfs (mmdebstrap, variant extract) shared by every image;
3. per image: a copy of it, the wheels pip-installed, trimmed, byte-compiled, tarred
   as the single layer, and written as an OCI archive with its names.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from images import definition, inputs, oci, rootfs

RECORD_NAME = "build.json"
# Builds of other keys kept beside the newest (other worktrees or branches on this
# machine may still use theirs); older ones are removed after a build (~0.5 GB each).
KEEP_OTHER_BUILDS = 3


@dataclasses.dataclass(frozen=True)
class Archive:
    """One built image: its OCI archive and the names containerd will know it by."""

    image: str
    path: Path
    # name:version-<key12>: names exactly this build (the tests run this one).
    reference: str
    # name:version: the chart's default tag (its appVersion).
    version_reference: str
    # The archive's size: the one uncompressed layer plus a few kB of JSON, so about
    # what the image takes on a node.
    size_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "path": str(self.path),
            "reference": self.reference,
            "version_reference": self.version_reference,
            "size_bytes": self.size_bytes,
        }


def tools_cache() -> Path:
    # Same default as the Makefile, which exports TOOLS_CACHE.
    default = Path.home() / ".cache" / "shardcache-tools"
    return Path(os.environ.get("TOOLS_CACHE") or default)


def project_version(repo: Path = inputs.REPO_ROOT) -> str:
    data = tomllib.loads((repo / "pyproject.toml").read_text())
    version: str = data["project"]["version"]
    return version


def _names(image: definition.Image, key: str, version: str) -> tuple[str, str]:
    return f"{image.name}:{version}-{key[:12]}", f"{image.name}:{version}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _log(message: str) -> None:
    print(f"images: {message}", file=sys.stderr, flush=True)


def wheelhouse(dest: Path) -> list[dict[str, Any]]:
    """Build every wheel the images install into `dest`; returns name and sha256 of each."""
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check"]
    rootfs.run(
        [*pip, "--no-deps", "--require-hashes", f"--wheel-dir={dest}", "-r", str(inputs.LOCK_FILE)],
        what="pip wheel (pinned dependencies)",
    )
    with tempfile.TemporaryDirectory(prefix="shardcache-src-") as src:
        inputs.copy_project(Path(src))
        rootfs.run([*pip, "--no-deps", f"--wheel-dir={dest}", src], what="pip wheel (project)")
    return [{"wheel": w.name, "sha256": oci.file_digest(w)} for w in sorted(dest.glob("*.whl"))]


def _build_image(
    image: definition.Image,
    *,
    base: definition.Base,
    base_rootfs: Path,
    wheels: Path,
    work: Path,
    out_dir: Path,
    names: tuple[str, str],
) -> dict[str, Any]:
    started = time.monotonic()
    root = work / f"rootfs-{image.key}"
    # Hard links would tie the copies' inodes together; a plain copy keeps them apart.
    shutil.copytree(base_rootfs, root, symlinks=True)
    rootfs.install_wheels(
        root, wheelhouse=wheels, requirement=image.requirement, drop_packages=image.drop_packages
    )
    for src, dst in image.files.items():
        target = root / dst.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(definition.IMAGES_DIR / src, target)
        target.chmod(0o755 if os.access(definition.IMAGES_DIR / src, os.X_OK) else 0o644)
    rootfs.trim(root, site_globs=base.site_trim)
    rootfs.link_duplicates(rootfs.site_packages(root))
    rootfs.finish(root, user=base.user, group=base.group)
    rootfs.compile_bytecode(root)
    layer = work / f"{image.key}.layer.tar"
    content = rootfs.write_layer(root, layer)
    shutil.rmtree(root)
    config = oci.image_config(
        diff_id=oci.file_digest(layer),
        user=f"{base.user}:{base.group}",
        env=definition.env_list(base),
        entrypoint=image.entrypoint,
        cmd=image.cmd,
        workdir=base.workdir,
        ports=image.ports,
        labels={"org.opencontainers.image.title": image.name},
    )
    archive = out_dir / f"{image.key}.oci.tar"
    manifest = oci.write_archive(layer=layer, config=config, names=list(names), out=archive)
    layer.unlink()
    return {
        "names": list(names),
        "archive": archive.name,
        "manifest_digest": manifest.digest,
        "content_bytes": content,
        "archive_bytes": archive.stat().st_size,
        "seconds": round(time.monotonic() - started, 1),
    }


def build(out_dir: Path, *, defn: definition.Definition, key: str, sources: list[str]) -> None:
    """Build every image of `defn` into `out_dir` and write its build record there."""
    started = time.monotonic()
    version = project_version()
    with tempfile.TemporaryDirectory(prefix="shardcache-image-", dir=out_dir.parent) as tmp:
        work = Path(tmp)
        _log("building wheels")
        wheels = work / "wheels"
        wheel_list = wheelhouse(wheels)
        _log(f"extracting Debian {defn.base.suite} packages (mmdebstrap)")
        base_root = work / "base"
        debs = rootfs.debian_rootfs(
            base_root, suite=defn.base.suite, packages=defn.base.packages, sources=sources
        )
        images: dict[str, Any] = {}
        for image in defn.images.values():
            _log(f"assembling {image.key}")
            images[image.key] = _build_image(
                image,
                base=defn.base,
                base_rootfs=base_root,
                wheels=wheels,
                work=work,
                out_dir=out_dir,
                names=_names(image, key, version),
            )
    record = {
        "key": key,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - started, 1),
        "debian_packages": debs,
        "wheels": wheel_list,
        "images": images,
    }
    (out_dir / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")


def _record(directory: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((directory / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data


def _prune(root: Path, *, keep: Path) -> None:
    built = sorted(
        (d for d in root.iterdir() if d != keep and (d / RECORD_NAME).is_file()),
        key=lambda d: (d / RECORD_NAME).stat().st_mtime,
        reverse=True,
    )
    for old in built[KEEP_OTHER_BUILDS:]:
        shutil.rmtree(old, ignore_errors=True)


def archives(*, cache: Path | None = None, build_missing: bool = True) -> Mapping[str, Archive]:
    """The archive of every image in images/image.toml, built first if missing.

    Keyed by image (`shardcache`, `trainer`). Raises FileNotFoundError when missing
    and `build_missing` is false; rootfs.BuildError when a build step fails.
    """
    defn = definition.load()
    sources = rootfs.apt_sources(defn.base.suite)
    key = inputs.content_key(suite_sources=sources, packages=defn.base.packages)
    root = (cache or tools_cache()) / "images"
    final = root / key[:16]
    with _locked(root / ".lock"):
        record = _record(final)
        if record is None or record.get("key") != key:
            if not build_missing:
                raise FileNotFoundError(f"no images built for key {key[:16]} in {root}")
            _log(f"no images for key {key[:16]} in {root}: building")
            # Under the lock no other build runs: work directories left here are
            # from a killed build (~1 GB each).
            for stale in [*root.glob("shardcache-image-*"), *root.glob(".*.partial"), final]:
                shutil.rmtree(stale, ignore_errors=True)
            partial = root / f".{key[:16]}.partial"
            partial.mkdir(parents=True)
            try:
                build(partial, defn=defn, key=key, sources=sources)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            os.replace(partial, final)
            _prune(root, keep=final)
            record = _record(final)
            assert record is not None
    result: dict[str, Archive] = {}
    for name, info in record["images"].items():
        reference, version_reference = info["names"]
        result[name] = Archive(
            image=name,
            path=final / info["archive"],
            reference=reference,
            version_reference=version_reference,
            size_bytes=int(info["archive_bytes"]),
        )
    return result


def docker_context(image: str, dest: Path) -> Archive:
    """Write the Docker/podman build context of `image` to `dest`: rootfs.tar + Dockerfile.

    The rootfs tarball is the OCI archive's layer, so both routes ship the same bytes.
    """
    defn = definition.load()
    found = archives()
    if image not in found:
        raise KeyError(f"no image {image!r} in images/image.toml (have {sorted(found)})")
    dest.mkdir(parents=True, exist_ok=True)
    oci.extract_layer(found[image].path, dest / "rootfs.tar")
    (dest / "Dockerfile").write_text(definition.dockerfile(defn.base, defn.images[image]))
    return found[image]


def write_lock(path: Path = inputs.LOCK_FILE) -> None:
    """Re-pin the images' dependencies: resolve every image's extras, write name==version
    with each wheel's sha256 (pip's dry-run report of this interpreter's platform)."""
    defn = definition.load()
    extras = sorted({e for image in defn.images.values() for e in image.extras})
    spec = f"{inputs.REPO_ROOT}[{','.join(extras)}]" if extras else str(inputs.REPO_ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        rootfs.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--dry-run",
                "--ignore-installed",
                f"--report={report}",
                spec,
            ],
            what="pip resolve",
        )
        data = json.loads(report.read_text())
    lines = [
        "# The images' Python dependencies, pinned with each wheel's sha256 (the images'",
        "# content key covers them). Regenerate: python -m images.build lock",
    ]
    for item in sorted(data["install"], key=lambda i: i["metadata"]["name"].lower()):
        if item.get("is_direct"):
            continue  # the project itself, built from source
        meta = item["metadata"]
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{meta['name']}=={meta['version']} --hash=sha256:{digest}")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m images.build", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the archives as JSON")
    sub = parser.add_subparsers(dest="command")
    ctx = sub.add_parser("docker-context", help="rootfs.tar + Dockerfile for docker/podman")
    ctx.add_argument("image")
    ctx.add_argument("dest", type=Path)
    sub.add_parser("lock", help="re-pin images/requirements.lock")
    args = parser.parse_args(argv)
    try:
        if args.command == "lock":
            write_lock()
            return 0
        if args.command == "docker-context":
            archive = docker_context(args.image, args.dest)
            print(archive.version_reference)
            return 0
        found = archives()
    except rootfs.BuildError as exc:
        print(f"images: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({k: a.to_json() for k, a in found.items()}, indent=2))
    else:
        for a in found.values():
            print(f"{a.image}\t{a.reference}\t{a.size_bytes / 1e6:.0f} MB\t{a.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
