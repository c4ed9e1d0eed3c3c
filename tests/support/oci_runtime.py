"""Run an OCI image archive's contents the way a kubelet would, without a kubelet.

`unpack()` lays an archive's layer out as a runc bundle; `run()` starts it with
Debian's runc under the image's own config (user, env, entrypoint) and a read-only
root, the pod settings the chart and the webhook use. `private_containerd()` starts
a containerd of its own (socket, root and state in a temporary directory, never the
machine's default socket, CRI off) for `ctr images import`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# What a container of a restricted pod keeps (the chart drops ALL): nothing.
_NO_CAPS: dict[str, list[str]] = {
    k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
}


@dataclasses.dataclass(frozen=True)
class Bundle:
    path: Path
    config: Mapping[str, Any]  # the image config's "config" object (User, Env, ...)


def _member(tar: tarfile.TarFile, digest: str) -> Any:
    member = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
    assert member is not None, f"blob {digest} missing"
    return member


def unpack(archive: Path, dest: Path) -> Bundle:
    """Extract the (single-manifest) image in `archive` to `dest`/rootfs."""
    rootfs = dest / "rootfs"
    rootfs.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        index_member = tar.extractfile("index.json")
        assert index_member is not None
        index = json.load(index_member)
        manifest = json.load(_member(tar, index["manifests"][0]["digest"]))
        image_config = json.load(_member(tar, manifest["config"]["digest"]))
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=_member(tar, layer["digest"]), mode="r|*") as layer_tar:
                # Root extracts with the layer's owners; "fully_trusted": it is our own
                # build, and the tar filter would refuse the absolute symlinks a
                # Debian tree has.
                layer_tar.extractall(rootfs, numeric_owner=True, filter="fully_trusted")
    return Bundle(dest, image_config["config"])


def _user(spec: str) -> dict[str, int]:
    uid, _, gid = spec.partition(":")
    return {"uid": int(uid), "gid": int(gid or uid)}


def runtime_spec(
    bundle: Bundle,
    args: Sequence[str] | None = None,
    *,
    mounts: Sequence[Mapping[str, Any]] = (),
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """An OCI runtime spec: the image's user, env and entrypoint, a read-only root."""
    cfg = bundle.config
    argv = list(args) if args is not None else [*cfg.get("Entrypoint", []), *cfg.get("Cmd", [])]
    environment = list(cfg.get("Env", []))
    environment += [f"{k}={v}" for k, v in (env or {}).items()]
    base_mounts: list[Mapping[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]  # fmt: skip
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": _user(cfg.get("User", "0")),
            "args": argv,
            "env": environment,
            "cwd": cfg.get("WorkingDir") or "/",
            "capabilities": _NO_CAPS,
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "image-test",
        "mounts": [*base_mounts, *mounts],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"],
        },
    }


def run(
    bundle: Bundle,
    args: Sequence[str] | None = None,
    *,
    mounts: Sequence[Mapping[str, Any]] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run `args` (default: the image's entrypoint + cmd) in the bundle with runc."""
    spec = runtime_spec(bundle, args, mounts=mounts, env=env)
    (bundle.path / "config.json").write_text(json.dumps(spec))
    name = f"shardcache-image-test-{secrets.token_hex(4)}"
    try:
        return subprocess.run(
            ["runc", "run", "--bundle", str(bundle.path), name],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        subprocess.run(["runc", "delete", "--force", name], capture_output=True)


@contextlib.contextmanager
def started(
    bundle: Bundle,
    args: Sequence[str] | None = None,
    *,
    name: str,
    mounts: Sequence[Mapping[str, Any]] = (),
    env: Mapping[str, str] | None = None,
    log: Path,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a long-lived container (a sidecar) while the block runs; killed after it.

    Each container gets its own bundle directory (runc reads config.json from it), so
    one image can run several containers at once.
    """
    spec = runtime_spec(bundle, args, mounts=mounts, env=env)
    spec["root"]["path"] = str(bundle.path / "rootfs")
    config_dir = bundle.path.parent / f"{bundle.path.name}-{name}"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(spec))
    container = f"shardcache-image-test-{name}-{secrets.token_hex(4)}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["runc", "run", "--bundle", str(config_dir), container],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        subprocess.run(["runc", "kill", container, "KILL"], capture_output=True)
        try:
            proc.wait(timeout=30)
        finally:
            subprocess.run(["runc", "delete", "--force", container], capture_output=True)
            shutil.rmtree(config_dir, ignore_errors=True)


def bind(source: Path, destination: str, *, readonly: bool = True) -> dict[str, Any]:
    return {
        "destination": destination,
        "type": "bind",
        "source": str(source),
        "options": ["rbind", "ro" if readonly else "rw"],
    }


def tmpfs(destination: str, *, size: str = "256m") -> dict[str, Any]:
    # mode 1777: the container's non-root user writes there, like an emptyDir.
    return {
        "destination": destination,
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "nodev", "mode=1777", f"size={size}"],
    }


@dataclasses.dataclass(frozen=True)
class Containerd:
    address: Path

    def ctr(self, *args: str, timeout: float = 300) -> str:
        proc = subprocess.run(
            ["ctr", "--address", str(self.address), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout


@contextlib.contextmanager
def private_containerd(workdir: Path) -> Iterator[Containerd]:
    """A containerd of its own under `workdir`; stopped and its state removed on exit.

    CRI is off (no kubelet talks to it) and so is every snapshotter but overlayfs
    (the native one), which `ctr images import` unpacks into.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    root, state = workdir / "root", workdir / "state"
    # Unix socket paths are limited to 107 bytes: a short directory of their own.
    sockets = Path(tempfile.mkdtemp(prefix="shardcache-ctd-"))
    address = sockets / "containerd.sock"
    config = workdir / "config.toml"
    config.write_text(
        "version = 2\n"
        f'root = "{root}"\n'
        f'state = "{state}"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs",'
        ' "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",'
        ' "io.containerd.snapshotter.v1.aufs"]\n'
        f'[grpc]\n  address = "{address}"\n'
        f'[ttrpc]\n  address = "{address}.ttrpc"\n'
        f'[debug]\n  address = "{sockets / "debug.sock"}"\n'
    )
    log = (workdir / "containerd.log").open("w")
    proc = subprocess.Popen(
        ["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while not address.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "containerd did not start: " + (workdir / "containerd.log").read_text()
                )
            time.sleep(0.1)
        yield Containerd(address)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        # Snapshots are overlay directories (no mounts remain after import); remove all.
        for path in (root, state):
            if path.exists():
                subprocess.run(["umount", "-R", str(path)], capture_output=True)
                shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)
