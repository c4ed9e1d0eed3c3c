"""Where the Go-built test tools are: `$TOOLS_CACHE/<name>-<version>/<binary>`.

The versions come from tests/cluster/versions.env, the file mk/tools.mk builds from, so
the fixtures run exactly the binaries `make test` built.
"""

from __future__ import annotations

import os
import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
VERSIONS_FILE = REPO_ROOT / "tests" / "cluster" / "versions.env"


def parse_versions(text: str) -> dict[str, str]:
    """KEY=VALUE lines of versions.env; blank lines and `#` comments are skipped."""
    versions: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{VERSIONS_FILE}: expected KEY=VALUE, found {line!r}")
        versions[key.strip()] = value.strip()
    return versions


def tools_cache() -> pathlib.Path:
    # Same default as the Makefile, which exports TOOLS_CACHE to `make test`.
    default = pathlib.Path.home() / ".cache" / "shardcache-tools"
    return pathlib.Path(os.environ.get("TOOLS_CACHE") or default)


def tool_binary(name: str, version_key: str, binary: str) -> pathlib.Path:
    """Path of `binary` in the cache directory of tool `name`; raises if not built.

    The error names the make target, because that is the one command that fixes it.
    """
    version = parse_versions(VERSIONS_FILE.read_text())[version_key]
    path = tools_cache() / f"{name}-{version}" / binary
    if not path.is_file():
        raise FileNotFoundError(
            f"{binary} {version} is not built: expected {path}; run `make tools-{name}` "
            "(`make test` does it) - it is built once and cached outside the repo"
        )
    return path
