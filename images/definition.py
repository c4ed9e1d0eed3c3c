"""The image definition (images/image.toml) as typed values, read once and validated.

Both build routes read this: the OCI writer (images/oci.py) takes the config from it,
and the Dockerfile for `make images` is rendered from it (`dockerfile()`), so the two
routes cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

IMAGES_DIR = Path(__file__).resolve().parent
DEFINITION_FILE = IMAGES_DIR / "image.toml"


class DefinitionError(ValueError):
    """images/image.toml is malformed: fix the file (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class Base:
    suite: str
    packages: tuple[str, ...]
    # Globs under the image's dist-packages to delete after pip install.
    site_trim: tuple[str, ...]
    user: int
    group: int
    workdir: str
    env: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Image:
    key: str
    name: str
    extras: tuple[str, ...]
    drop_packages: tuple[str, ...]
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    ports: tuple[int, ...]
    # Source path under images/ -> absolute path in the image.
    files: Mapping[str, str]

    @property
    def requirement(self) -> str:
        """What pip installs: the project with this image's extras."""
        return f"shardcache[{','.join(self.extras)}]" if self.extras else "shardcache"


@dataclasses.dataclass(frozen=True)
class Definition:
    base: Base
    images: Mapping[str, Image]


def _strings(value: Any, *, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DefinitionError(f"{DEFINITION_FILE.name}: {where} must be a list of strings")
    return tuple(value)


def _table(data: Mapping[str, Any], key: str, *, where: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise DefinitionError(f"{DEFINITION_FILE.name}: {where}.{key} must be a table")
    return value


def _int(data: Mapping[str, Any], key: str, *, where: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DefinitionError(f"{DEFINITION_FILE.name}: {where}.{key} must be an integer")
    return value


def _str(data: Mapping[str, Any], key: str, *, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise DefinitionError(f"{DEFINITION_FILE.name}: {where}.{key} must be a string")
    return value


def parse(text: str) -> Definition:
    """The definition in `text` (TOML); raises DefinitionError naming a bad field."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DefinitionError(f"{DEFINITION_FILE.name}: {exc}") from exc
    base_data = _table(data, "base", where="")
    env = _table(base_data, "env", where="base")
    if not all(isinstance(v, str) for v in env.values()):
        raise DefinitionError(f"{DEFINITION_FILE.name}: base.env values must be strings")
    base = Base(
        suite=_str(base_data, "suite", where="base"),
        packages=_strings(base_data.get("packages"), where="base.packages"),
        site_trim=_strings(base_data.get("site_trim", []), where="base.site_trim"),
        user=_int(base_data, "user", where="base"),
        group=_int(base_data, "group", where="base"),
        workdir=_str(base_data, "workdir", where="base"),
        env=dict(env),
    )
    images: dict[str, Image] = {}
    for key, raw in _table(data, "images", where="").items():
        where = f"images.{key}"
        if not isinstance(raw, dict):
            raise DefinitionError(f"{DEFINITION_FILE.name}: {where} must be a table")
        files = _table(raw, "files", where=where)
        for src, dst in files.items():
            if not isinstance(dst, str) or not dst.startswith("/"):
                raise DefinitionError(
                    f"{DEFINITION_FILE.name}: {where}.files[{src!r}] must be an absolute "
                    f"path in the image, found {dst!r}"
                )
        ports = raw.get("ports", [])
        if not isinstance(ports, list) or not all(isinstance(p, int) for p in ports):
            raise DefinitionError(f"{DEFINITION_FILE.name}: {where}.ports must be integers")
        images[key] = Image(
            key=key,
            name=_str(raw, "name", where=where),
            extras=_strings(raw.get("extras", []), where=f"{where}.extras"),
            drop_packages=_strings(raw.get("drop_packages", []), where=f"{where}.drop_packages"),
            entrypoint=_strings(raw.get("entrypoint"), where=f"{where}.entrypoint"),
            cmd=_strings(raw.get("cmd", []), where=f"{where}.cmd"),
            ports=tuple(ports),
            files=dict(files),
        )
    if not images:
        raise DefinitionError(f"{DEFINITION_FILE.name}: no [images.*] table")
    return Definition(base=base, images=images)


def load(path: Path = DEFINITION_FILE) -> Definition:
    return parse(path.read_text())


def env_list(base: Base) -> list[str]:
    """The environment as OCI config writes it: sorted KEY=VALUE strings."""
    return [f"{k}={v}" for k, v in sorted(base.env.items())]


def dockerfile(base: Base, image: Image) -> str:
    """The Dockerfile of the Docker/podman route: the rootfs tarball plus this config.

    JSON (exec) forms throughout, so nothing here needs a shell in the image.
    """
    lines = [
        "# Rendered by images/build.py from images/image.toml; do not edit.",
        "FROM scratch",
        "ADD rootfs.tar /",
        *(f"ENV {k}={json.dumps(v)}" for k, v in sorted(base.env.items())),
        f"USER {base.user}:{base.group}",
        f"WORKDIR {base.workdir}",
    ]
    if image.ports:
        lines.append("EXPOSE " + " ".join(str(p) for p in image.ports))
    lines.append(f"ENTRYPOINT {json.dumps(list(image.entrypoint))}")
    lines.append(f"CMD {json.dumps(list(image.cmd))}")
    return "\n".join(lines) + "\n"
