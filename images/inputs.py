"""The images' content key: one sha256 over everything that decides their bytes.

Inputs: the definition (images/image.toml), the build code and the trainer script
(everything under images/ but its docs), the pinned wheels (images/requirements.lock
holds each wheel's sha256, so the key covers the wheels' contents without downloading
them), the project's own sources (the files its wheel is built from), the Debian
package list with this machine's apt entries for the suite, and the build
interpreter's minor version (it writes the bytecode). Computing it reads files only,
so a second build of unchanged inputs is a no-op that costs milliseconds.

Not covered: new Debian point releases behind the same apt entries (the key cannot
see them without an `apt-get update`); delete $TOOLS_CACHE/images to pick them up.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from images import definition

REPO_ROOT = definition.IMAGES_DIR.parent
LOCK_FILE = definition.IMAGES_DIR / "requirements.lock"
# What the project's wheel is built from (pyproject.toml's packages.find + readme).
PROJECT_FILES = ("pyproject.toml", "README.md")
PROJECT_DIRS = ("shardcache", "sidecar/shardcache_sidecar", "operator/shardcache_operator")
_SKIP_DIRS = {"__pycache__", ".mypy_cache", ".pytest_cache"}


def _files_under(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            if not name.endswith((".pyc", ".pyo")):
                yield Path(dirpath) / name


def project_files(repo: Path = REPO_ROOT) -> list[Path]:
    """The project files its wheel is built from, relative to `repo`, sorted."""
    files = [Path(f) for f in PROJECT_FILES]
    for d in PROJECT_DIRS:
        files += [p.relative_to(repo) for p in _files_under(repo / d)]
    return sorted(files)


def definition_files(images_dir: Path = definition.IMAGES_DIR) -> list[Path]:
    """The files under images/ that shape the images (all but docs), relative, sorted."""
    return sorted(p.relative_to(images_dir) for p in _files_under(images_dir) if p.suffix != ".md")


def copy_project(dest: Path, repo: Path = REPO_ROOT) -> None:
    """Copy exactly the keyed project files to `dest`, for `pip wheel` to build from.

    Building from a copy keeps setuptools' build/ and *.egg-info out of the work tree
    and makes the wheel a function of the hashed files alone.
    """
    for rel in project_files(repo):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)


def content_key(
    *, suite_sources: Sequence[str], packages: Sequence[str], repo: Path = REPO_ROOT
) -> str:
    """The hex sha256 of all inputs (see the module docstring)."""
    h = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        h.update(f"{label}\0{len(data)}\0".encode())
        h.update(data)

    images_dir = repo / "images"
    for rel in definition_files(images_dir):
        add(f"images/{rel}", (images_dir / rel).read_bytes())
    for rel in project_files(repo):
        add(str(rel), (repo / rel).read_bytes())
    add("debian-packages", "\n".join(packages).encode())
    add("apt-sources", "\n".join(suite_sources).encode())
    add("python", f"{sys.version_info.major}.{sys.version_info.minor}".encode())
    return h.hexdigest()
