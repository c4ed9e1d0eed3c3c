"""The images, built for real (images/build.py) and run the way a node runs them.

`make test` builds the archives first (`make image-archives`, cached by content key);
here `build.archives()` finds them, or builds them when run alone. Each image is
unpacked and run with Debian's runc under its own config (uid 65532, read-only root,
no capabilities), and imported into a private containerd with `ctr images import`,
the path the node tier takes.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from images import build, definition, oci
from tests.support import oci_runtime

pytestmark = [pytest.mark.integration, pytest.mark.image]

SIZE_LIMIT_BYTES = 350 * 10**6
ROWS_PER_SHARD = 1000
SHARDS = 4
IMAGE_USER = "65532:65532"

# Run in the image: import every module of the named packages; print the failures.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
failed = {}
for top in sys.argv[1:]:
    pkg = importlib.import_module(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + "."):
        if info.name.endswith(".__main__"):
            continue  # runs the program
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            failed[info.name] = "missing " + str(exc.name)
        except Exception as exc:
            failed[info.name] = repr(exc)
print(json.dumps(failed))
"""
# Modules an image may lack: optional extras it does not install (the inspect TUI),
# test helpers and plugins of third-party packages, GPU builds.
OPTIONAL_MISSING = {
    "missing rich",
    "missing textual",
    "missing tokenizers",
    "missing pytest",
    "missing gunicorn",
    "missing pyarrow._cuda",
    "missing kubernetes.e2e_test",
    # The framework adapters (shardcache.torch, .jax, .numpy) are the trainer's extras:
    # the service image runs the operator and the sidecar, which use none of them.
    "missing torch",
    "missing jax",
    "missing numpy",
}


@pytest.fixture(scope="module")
def archives() -> Mapping[str, build.Archive]:
    return build.archives()


@pytest.fixture(scope="module")
def service_bundle(
    archives: Mapping[str, build.Archive], tmp_path_factory: pytest.TempPathFactory
) -> oci_runtime.Bundle:
    return oci_runtime.unpack(archives["shardcache"].path, tmp_path_factory.mktemp("shardcache"))


@pytest.fixture(scope="module")
def trainer_bundle(
    archives: Mapping[str, build.Archive], tmp_path_factory: pytest.TempPathFactory
) -> oci_runtime.Bundle:
    return oci_runtime.unpack(archives["trainer"].path, tmp_path_factory.mktemp("trainer"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Parquet shards with ids 0..N-1: the trainer's tallies have known totals."""
    root = tmp_path_factory.mktemp("dataset")
    for i in range(SHARDS):
        ids = pa.array(range(i * ROWS_PER_SHARD, (i + 1) * ROWS_PER_SHARD), pa.int64())
        pq.write_table(pa.table({"id": ids}), root / f"part-{i:03d}.parquet")
    root.chmod(0o755)
    return root


def _totals(n: int) -> dict[str, int]:
    return {"rows": n, "id_sum": n * (n - 1) // 2, "id_sq_sum": (n - 1) * n * (2 * n - 1) // 6}


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _result(stdout: str) -> dict[str, object]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("SHARDCACHE_RESULT ")]
    assert len(lines) == 1, stdout
    data: dict[str, object] = json.loads(lines[0].removeprefix("SHARDCACHE_RESULT "))
    return data


def test_images_fit_the_size_budget(archives: Mapping[str, build.Archive]) -> None:
    sizes = {name: a.size_bytes for name, a in archives.items()}
    assert set(sizes) == {"shardcache", "trainer"}
    assert all(s <= SIZE_LIMIT_BYTES for s in sizes.values()), sizes


def test_second_build_finds_the_cached_archives(archives: Mapping[str, build.Archive]) -> None:
    stamps = {name: a.path.stat().st_mtime_ns for name, a in archives.items()}
    started = time.monotonic()
    again = build.archives(build_missing=False)
    assert time.monotonic() - started < 5
    assert again == archives
    assert {name: a.path.stat().st_mtime_ns for name, a in again.items()} == stamps


def test_archive_names_the_image_for_containerd(archives: Mapping[str, build.Archive]) -> None:
    for archive in archives.values():
        index = oci.read_index(archive.path)
        names = [m["annotations"][oci.ANNOTATION_CONTAINERD_NAME] for m in index["manifests"]]
        assert names == [archive.reference, archive.version_reference]
        assert archive.reference.startswith(archive.version_reference + "-")


def test_image_config_is_the_definition(service_bundle: oci_runtime.Bundle) -> None:
    base = definition.load().base
    config = service_bundle.config
    assert config["User"] == IMAGE_USER == f"{base.user}:{base.group}"
    assert config["Entrypoint"] == ["shardcache"]
    assert "PYTHONDONTWRITEBYTECODE=1" in config["Env"]


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (None, "run the node cache sidecar"),  # the image's own entrypoint + cmd
        (["shardcache", "sidecar", "--help"], "usage: shardcache sidecar"),
        (["shardcache", "operator", "--help"], "usage: shardcache operator"),
        # The chart's node-cache DaemonSet runs `python -c …` in this image, or its reclaim.
        (["python", "-c", "import os; print('python as', os.getuid())"], "python as 65532"),
        (
            ["python3", "-m", "shardcache_operator.node_reclaim", "--help"],
            "usage: python3 -m shardcache_operator.node_reclaim",
        ),
    ],
)
def test_entry_commands_run_as_nonroot_on_a_readonly_root(
    service_bundle: oci_runtime.Bundle, args: list[str] | None, expect: str
) -> None:
    assert expect in _ok(oci_runtime.run(service_bundle, args))


def test_root_filesystem_is_readonly_and_user_is_65532(
    service_bundle: oci_runtime.Bundle,
) -> None:
    probe = (
        "import os, sys\n"
        "print(os.getuid(), os.getgid(), sys.flags.dont_write_bytecode)\n"
        "for p in ('/x', '/usr/local/lib/x', '/home/nonroot/x'):\n"
        "    try:\n"
        "        open(p, 'w')\n"
        "    except OSError as e:\n"
        "        print(p, e.errno)\n"
    )
    out = _ok(oci_runtime.run(service_bundle, ["python3", "-c", probe])).split("\n")
    assert out[0] == "65532 65532 1"
    erofs = 30
    assert out[1:4] == [f"/x {erofs}", f"/usr/local/lib/x {erofs}", f"/home/nonroot/x {erofs}"]


def test_tls_trust_store_holds_the_debian_ca_bundle(service_bundle: oci_runtime.Bundle) -> None:
    # HTTPS object stores and the API server's client libraries verify against it.
    probe = "import ssl; print(ssl.create_default_context().cert_store_stats()['x509_ca'])"
    assert int(_ok(oci_runtime.run(service_bundle, ["python3", "-c", probe]))) > 100


def test_every_module_of_the_service_imports(service_bundle: oci_runtime.Bundle) -> None:
    packages = ["shardcache", "shardcache_sidecar", "shardcache_operator", "kopf", "aiohttp"]
    # The trimmed packages too: a trim that removed something used shows up here.
    packages += ["pyarrow", "kubernetes"]
    out = _ok(oci_runtime.run(service_bundle, ["python3", "-c", IMPORT_ALL, *packages]))
    failed = json.loads(out.splitlines()[-1])
    unexpected = {
        name: why
        for name, why in failed.items()
        # Shared libraries that walk_packages takes for modules; a kubernetes example
        # that loads a kubeconfig at import.
        if why not in OPTIONAL_MISSING
        and not name.startswith("pyarrow.libarrow_python")
        and name != "kubernetes.leaderelection.example"
    }
    assert unexpected == {}


def test_bytecode_is_precompiled_for_the_image_paths(service_bundle: oci_runtime.Bundle) -> None:
    # This interpreter's magic number, and flags 0b11: checked-hash pycs, valid whatever
    # mtimes the layer carries.
    probe = (
        "import importlib, importlib.util, sys\n"
        "for name in sys.argv[1:]:\n"
        "    mod = importlib.import_module(name)\n"
        "    with open(importlib.util.cache_from_source(mod.__file__), 'rb') as f:\n"
        "        head = f.read(8)\n"
        "    ok = head[:4] == importlib.util.MAGIC_NUMBER and head[4] == 0b11\n"
        "    print(name, ok)\n"
    )
    names = ["json", "asyncio", "shardcache", "shardcache_sidecar.cli", "kopf", "pyarrow"]
    out = _ok(oci_runtime.run(service_bundle, ["python3", "-c", probe, *names]))
    assert out.split() == [w for n in names for w in (n, "True")]


def test_trainer_image_has_the_client_library_only(trainer_bundle: oci_runtime.Bundle) -> None:
    probe = (
        "import importlib\n"
        "for name in ('shardcache', 'pyarrow', 'pyarrow.parquet', 'shardcache_sidecar',"
        " 'shardcache_operator', 'aiohttp', 'kubernetes'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        print(name, 'ok')\n"
        "    except ModuleNotFoundError:\n"
        "        print(name, 'absent')\n"
    )
    out = _ok(oci_runtime.run(trainer_bundle, ["python3", "-c", probe]))
    assert out.splitlines() == [
        "shardcache ok",
        "pyarrow ok",
        "pyarrow.parquet ok",
        "shardcache_sidecar absent",
        "shardcache_operator absent",
        "aiohttp absent",
        "kubernetes absent",
    ]


def _train(
    bundle: oci_runtime.Bundle,
    dataset: Path,
    *args: str,
    env: Mapping[str, str],
    checkpoints: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    mounts = [oci_runtime.bind(dataset, "/data"), oci_runtime.tmpfs("/tmp")]
    if checkpoints is not None:
        mounts.append(oci_runtime.bind(checkpoints, "/checkpoints", readonly=False))
    command = ["python3", "/opt/shardcache/train.py", "--source", "file:///data"]
    command += ["--cache-dir", "/tmp/cache", *args]
    return oci_runtime.run(bundle, command, mounts=mounts, env=env)


def test_trainer_ranks_read_every_row_exactly_once(
    trainer_bundle: oci_runtime.Bundle, dataset: Path
) -> None:
    results = [
        _result(
            _ok(_train(trainer_bundle, dataset, env={"JOB_COMPLETION_INDEX": str(rank),
                                                     "SHARDCACHE_WORLD_SIZE": "2"}))
        )
        for rank in (0, 1)
    ]  # fmt: skip
    assert [r["rank"] for r in results] == [0, 1]
    summed = {k: sum(int(str(r[k])) for r in results) for k in ("rows", "id_sum", "id_sq_sum")}
    assert summed == _totals(SHARDS * ROWS_PER_SHARD)


def test_trainer_resumes_from_its_checkpoint_at_the_next_sample(
    trainer_bundle: oci_runtime.Bundle, dataset: Path, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    os.chown(checkpoints, 65532, 65532)
    env = {"SHARDCACHE_CHECKPOINT_DIR": "/checkpoints"}
    args = ("--batch-size", "100", "--checkpoint-every", "2")
    first = _train(
        trainer_bundle, dataset, *args, "--fail-after-batches", "5", env=env,
        checkpoints=checkpoints,
    )  # fmt: skip
    assert first.returncode == 3, first.stdout + first.stderr
    # Batches 1-5 were read, checkpoints after 2 and 4: the fifth is read again.
    assert "committed checkpoint step 2 at row 400" in first.stdout
    second = _result(_ok(_train(trainer_bundle, dataset, *args, env=env, checkpoints=checkpoints)))
    assert second["resumed_from_step"] == 2
    assert second["start"] == {"epoch": 0, "position": 400}
    got = {k: second[k] for k in ("rows", "id_sum", "id_sq_sum")}
    assert got == _totals(SHARDS * ROWS_PER_SHARD)


def test_containerd_imports_and_runs_both_archives(
    archives: Mapping[str, build.Archive], tmp_path: Path
) -> None:
    with oci_runtime.private_containerd(tmp_path / "containerd") as containerd:
        for archive in archives.values():
            containerd.ctr("images", "import", str(archive.path))
        listed = set(containerd.ctr("images", "ls", "--quiet").split())
        for archive in archives.values():
            assert {archive.reference, archive.version_reference} <= listed
        probe = "import os, shardcache, pyarrow; print(os.getuid(), shardcache.__version__)"
        out = containerd.ctr(
            # A unique id: runc's state directory for the namespace is machine-wide.
            "run", "--rm", "--read-only", archives["trainer"].reference,
            f"shardcache-image-test-{secrets.token_hex(4)}",
            "python3", "-c", probe,
        )  # fmt: skip
        assert out.split() == ["65532", build.project_version()]


def test_dockerfile_route_ships_the_same_rootfs(
    archives: Mapping[str, build.Archive], tmp_path: Path
) -> None:
    archive = build.docker_context("shardcache", tmp_path)
    assert archive == archives["shardcache"]
    dockerfile = (tmp_path / "Dockerfile").read_text().splitlines()
    assert dockerfile[1:3] == ["FROM scratch", "ADD rootfs.tar /"]
    assert f"USER {IMAGE_USER}" in dockerfile
    assert 'ENTRYPOINT ["shardcache"]' in dockerfile
    layer_digest = oci.read_manifest(archive.path)["layers"][0]["digest"]
    assert oci.file_digest(tmp_path / "rootfs.tar") == layer_digest


def test_sidecar_serves_trainers_in_their_containers_like_a_pod(
    service_bundle: oci_runtime.Bundle,
    trainer_bundle: oci_runtime.Bundle,
    dataset: Path,
    tmp_path: Path,
) -> None:
    """The sidecar image serving (not just --help) with a read-only root and only its
    volumes writable: the run directory (socket, memory tier) shared with the trainer
    containers, and the node disk tier, the way the webhook lays out a pod."""
    run_dir, disk_dir = tmp_path / "run", tmp_path / "disk"
    for d in (run_dir, disk_dir):
        d.mkdir()
        os.chown(d, 65532, 65532)
    common = {"SHARDCACHE_RUN_DIR": "/run/shardcache", "SHARDCACHE_MOUNT": "m"}
    sidecar_env = {
        **common,
        "SHARDCACHE_SOURCE_URI": "file:///data",
        "SHARDCACHE_DISK_DIR": "/node-cache",
        "SHARDCACHE_MEMORY_LIMIT_BYTES": str(64 << 20),
        "SHARDCACHE_DISK_LIMIT_BYTES": str(64 << 20),
    }
    log = tmp_path / "sidecar.log"
    with oci_runtime.started(
        service_bundle,
        ["shardcache", "sidecar"],
        name="sidecar",
        mounts=[
            oci_runtime.bind(dataset, "/data"),
            oci_runtime.bind(run_dir, "/run/shardcache", readonly=False),
            oci_runtime.bind(disk_dir, "/node-cache", readonly=False),
        ],
        env=sidecar_env,
        log=log,
    ) as sidecar:
        deadline = time.monotonic() + 60
        while not list(run_dir.rglob("*.sock")):
            assert sidecar.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no control socket:\n" + log.read_text()
            time.sleep(0.2)
        results = []
        for rank in (0, 1):
            proc = oci_runtime.run(
                trainer_bundle,
                mounts=[oci_runtime.bind(run_dir, "/run/shardcache", readonly=False)],
                env={**common, "SHARDCACHE_RANK": str(rank), "SHARDCACHE_WORLD_SIZE": "2"},
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr + log.read_text()
            results.append(_result(proc.stdout))
        assert sidecar.poll() is None, log.read_text()
    summed = {k: sum(int(str(r[k])) for r in results) for k in ("rows", "id_sum", "id_sq_sum")}
    assert summed == _totals(SHARDS * ROWS_PER_SHARD)
    assert "Read-only file system" not in log.read_text()
    # The node disk tier got the shards: written by 65532 through its volume.
    cached = [p for p in disk_dir.rglob("*") if p.is_file()]
    assert cached and all(p.stat().st_uid == 65532 for p in cached)
