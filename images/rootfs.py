"""The image's root filesystem: Debian packages, the project's wheels, then trimmed.

Debian's packages are *extracted* by mmdebstrap (variant `extract`), never installed:
no dpkg, apt, shell or maintainer scripts end up in the image, and this module does
the little the maintainer scripts would have done (the CA bundle, the linker cache,
byte-compiling). mmdebstrap fetches from the apt sources this machine is configured
with, read at build time (`apt_sources()`), so the repository names no mirror.

Everything here needs root (or mmdebstrap's unshare mode) for file ownership; the
build runs as root on the project machine.
"""

from __future__ import annotations

import compileall
import hashlib
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

APT_SOURCES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))
# What the image never needs: documentation, translations, the package manager's
# state (nothing is installed in it later), iconv modules (Python has its own codecs),
# the perl of debconf (ca-certificates' configuration script, never run here).
TRIM_PATHS = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/perl5",
    "usr/share/debconf",
    "usr/share/bug",
    "usr/lib/x86_64-linux-gnu/gconv",
    "etc/apt",
    "var/cache",
    "var/lib/apt",
    "var/lib/dpkg",
    "var/log",
)
# Standard-library parts no server uses (tests alone are ~30 MB when present).
TRIM_STDLIB = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data")
# Inside installed wheels: test suites, C/Cython sources and headers (pyarrow ships
# ~20 MB of them for building extensions against it, which an image never does).
TRIM_SITE_DIRS = ("tests", "test", "include", "src")
TRIM_SITE_SUFFIXES = (".pxd", ".pyx", ".pxi", ".h", ".hpp", ".cc", ".cpp", ".c")
EXCLUDE_FROM_PACKAGES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*")


class BuildError(RuntimeError):
    """A build step failed; the message carries the step's own output."""


def run(cmd: Sequence[str], *, what: str, cwd: Path | None = None) -> str:
    """Run `cmd`; on failure raise BuildError with the tail of its output."""
    proc = subprocess.run(
        list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise BuildError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc.stdout


# --- apt sources ------------------------------------------------------------------------
def _suite_family(suite: str) -> set[str]:
    return {suite, f"{suite}-updates", f"{suite}-security"}


def _deb822_lines(text: str, suites: set[str]) -> Iterator[str]:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in fields.get("types", "").split():
            continue
        options = f" [signed-by={fields['signed-by']}]" if "signed-by" in fields else ""
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                if suite in suites:
                    yield f"deb{options} {uri} {suite} {fields.get('components', 'main')}"


def _one_line_entries(text: str, suites: set[str]) -> Iterator[str]:
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        rest = words[1:]
        if rest and rest[0].startswith("["):
            while rest and not rest[0].endswith("]"):
                rest = rest[1:]
            rest = rest[1:]
        if len(rest) >= 2 and rest[1] in suites:
            yield " ".join(words)


def apt_sources(suite: str, paths: Iterable[Path] = APT_SOURCES) -> list[str]:
    """This machine's apt entries for `suite` (and its -updates/-security), one-line form.

    Read from /etc/apt at build time, so the repository never names a mirror; other
    suites and third-party repositories on the host are left out.
    """
    suites = _suite_family(suite)
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".list", ".sources"))
        elif path.is_file():
            files.append(path)
    entries: list[str] = []
    for f in files:
        text = f.read_text()
        found = _deb822_lines(text, suites) if f.suffix == ".sources" else None
        entries += found if found is not None else _one_line_entries(text, suites)
    if not entries:
        raise BuildError(
            f"no apt source for Debian {suite} in {', '.join(map(str, paths))}: the image "
            f"is built from this machine's configured {suite} archive"
        )
    return entries


# --- the rootfs -------------------------------------------------------------------------
def debian_rootfs(
    target: Path, *, suite: str, packages: Sequence[str], sources: Sequence[str]
) -> list[str]:
    """Extract `packages` and their dependencies into `target`; returns the .deb names."""
    if shutil.which("mmdebstrap") is None:
        raise BuildError("mmdebstrap is not installed: apt-get install mmdebstrap")
    with tempfile.TemporaryDirectory(prefix="shardcache-apt-") as tmp:
        sources_file = Path(tmp) / "sources.list"
        sources_file.write_text("\n".join(sources) + "\n")
        debs = Path(tmp) / "debs.txt"
        run(
            [
                "mmdebstrap",
                "--variant=extract",
                "--mode=auto",
                "--format=directory",
                "--quiet",
                f"--include={','.join(packages)}",
                *(f"--dpkgopt=path-exclude={p}" for p in EXCLUDE_FROM_PACKAGES),
                # The packages' names and versions, for the build record.
                f'--extract-hook=ls "$1/var/cache/apt/archives" > {debs}',
                suite,
                str(target),
                str(sources_file),
            ],
            what="mmdebstrap",
        )
        packages_found = sorted(n for n in debs.read_text().split() if n.endswith(".deb"))
    # mmdebstrap leaves device nodes in /dev; the runtime mounts its own /dev, and a
    # copy of the tree would try to read them.
    shutil.rmtree(target / "dev")
    (target / "dev").mkdir()
    return packages_found


def python_version(rootfs: Path) -> str:
    """ "3.11": the Debian interpreter's version, from its standard library directory."""
    found = sorted(
        p.name.removeprefix("python")
        for p in (rootfs / "usr/lib").glob("python3.*")
        if (p / "os.py").is_file()
    )
    if len(found) != 1:
        raise BuildError(f"expected one python3.X standard library in {rootfs}, found {found}")
    return found[0]


def site_packages(rootfs: Path) -> Path:
    # Debian's python3 searches /usr/local/lib/python3.X/dist-packages (not
    # site-packages): the place pip would install to inside the image.
    return rootfs / f"usr/local/lib/python{python_version(rootfs)}/dist-packages"


def install_wheels(
    rootfs: Path, *, wheelhouse: Path, requirement: str, drop_packages: Sequence[str]
) -> None:
    """pip-install `requirement` from `wheelhouse` alone (no index) into the image.

    pip runs here, not in the image (which has no pip): --target puts the packages in
    the image's dist-packages, and the console scripts get the image's interpreter.
    """
    target = site_packages(rootfs)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            f"--find-links={wheelhouse}",
            "--no-compile",
            "--no-cache-dir",
            "--disable-pip-version-check",
            f"--target={target}",
            requirement,
        ],
        what=f"pip install {requirement}",
    )
    for name in drop_packages:
        shutil.rmtree(target / name)
    bin_dir = rootfs / "usr/local/bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    scripts = target / "bin"
    if scripts.is_dir():
        for script in scripts.iterdir():
            text = script.read_bytes()
            if text.startswith(b"#!"):
                # pip wrote the build interpreter's path; the image has its own.
                text = b"#!/usr/bin/python3" + text[text.index(b"\n") :]
            dest = bin_dir / script.name
            dest.write_bytes(text)
            dest.chmod(0o755)
        shutil.rmtree(scripts)


def trim(rootfs: Path, *, site_globs: Sequence[str] = ()) -> None:
    """Remove what the image never uses: TRIM_*, and `site_globs` under dist-packages."""
    for rel in TRIM_PATHS:
        path = rootfs / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    stdlib = rootfs / f"usr/lib/python{python_version(rootfs)}"
    for name in TRIM_STDLIB:
        shutil.rmtree(stdlib / name, ignore_errors=True)
    site = site_packages(rootfs)
    for pattern in site_globs:
        for path in site.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    for top in site.iterdir() if site.is_dir() else ():
        if not top.is_dir() or top.name.endswith((".dist-info", ".libs")):
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            for d in [d for d in dirnames if d in TRIM_SITE_DIRS or d == "__pycache__"]:
                shutil.rmtree(Path(dirpath) / d)
                dirnames.remove(d)
            for f in filenames:
                if f.endswith(TRIM_SITE_SUFFIXES):
                    (Path(dirpath) / f).unlink()
    for cache in list(rootfs.rglob("__pycache__")):
        shutil.rmtree(cache)


def link_duplicates(root: Path, *, min_size: int = 1 << 20) -> int:
    """Hard-link identical large files under `root`; returns the bytes saved.

    Wheels cannot carry symlinks, so a library's soname aliases arrive as full
    copies (pyarrow's libarrow_python.so three times); the layer stores a hard link
    once.
    """
    by_size: dict[int, list[Path]] = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_size >= min_size:
            by_size.setdefault(path.stat().st_size, []).append(path)
    saved = 0
    for size, paths in by_size.items():
        seen: dict[bytes, Path] = {}
        for path in sorted(paths):
            digest = hashlib.sha256(path.read_bytes()).digest()
            if digest in seen:
                path.unlink()
                os.link(seen[digest], path)
                saved += size
            else:
                seen[digest] = path
    return saved


def finish(rootfs: Path, *, user: int, group: int) -> None:
    """Do what the skipped maintainer scripts would have, and add the non-root user."""
    etc = rootfs / "etc"
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        f"nonroot:x:{user}:{group}:nonroot:/home/nonroot:/usr/sbin/nologin\n"
    )
    (etc / "group").write_text(f"root:x:0:\nnonroot:x:{group}:\n")
    home = rootfs / "home/nonroot"
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, user, group)
    # Mount points: the runtime mounts these; /tmp is where a pod's emptyDir goes.
    for d in ("proc", "sys", "dev", "run", "tmp", "root"):
        (rootfs / d).mkdir(exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)
    (rootfs / "root").chmod(0o700)
    # The `python` name the chart's node-cache DaemonSet runs (python-is-python3 would
    # pull the full python3 package for one symlink).
    python = rootfs / "usr/bin/python"
    if not python.exists():
        python.symlink_to("python3")
    # update-ca-certificates' bundle (SSL_CERT_FILE points at it).
    certs = sorted((rootfs / "usr/share/ca-certificates").rglob("*.crt"))
    bundle = rootfs / "etc/ssl/certs/ca-certificates.crt"
    bundle.parent.mkdir(parents=True, exist_ok=True)
    bundle.write_text("".join(c.read_text() for c in certs))
    conf = etc / "ld.so.conf"
    if not conf.exists():
        conf.write_text("include /etc/ld.so.conf.d/*.conf\n")
    run(["ldconfig", "-r", str(rootfs)], what="ldconfig")


def compile_bytecode(rootfs: Path) -> None:
    """Byte-compile the standard library and the installed packages.

    The root filesystem is read-only at run time, so nothing could write bytecode
    later. The compiler is this interpreter, so its version must be the image's
    (the bytecode format changes between 3.X releases). The recorded path is the one
    in the image; checked-hash pycs stay valid whatever mtimes the layer carries.
    """
    version = python_version(rootfs)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here != version:
        raise BuildError(
            f"the image has python {version} but the build runs {here}: run the build "
            f"with a python{version} (make image-archives uses the project's .venv)"
        )
    for rel in (f"usr/lib/python{version}", f"usr/local/lib/python{version}/dist-packages"):
        ok = compileall.compile_dir(
            rootfs / rel,
            quiet=2,
            workers=0,
            stripdir=str(rootfs),
            prependdir="/",
            invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH,
        )
        # Some stdlib/test-data files are deliberately not valid Python 3.X (e.g. the
        # lib2to3 grammar fixtures): compile_dir reports them; only a total failure
        # would leave the image without bytecode.
        if not ok:
            print(f"note: some files under /{rel} did not compile (kept as source)")


def write_layer(rootfs: Path, out: Path) -> int:
    """Tar `rootfs` (sorted, numeric owners) into `out`; returns the content's byte size."""
    total = 0

    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        nonlocal total
        info.uname = info.gname = ""
        total += info.size
        return info

    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(rootfs):
            dirnames.sort()
            base = Path(dirpath)
            for name in sorted(dirnames) + sorted(filenames):
                path = base / name
                tar.add(
                    path, arcname=str(path.relative_to(rootfs)), recursive=False, filter=normalise
                )
    os.replace(tmp, out)
    return total
