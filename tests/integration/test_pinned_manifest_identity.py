"""A second sidecar on the node whose source names one file, spelled as the user wrote
it (percent-encoded, with "." segments), takes the manifest the first one kept in the
node disk tier: counted, it resolves from the source once, not twice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardcache import contract, manifests
from tests.support import datasets
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]


def loads(proc: SidecarProcess, origin: str) -> int:
    _, text = proc.http_get("/metrics")
    for line in text.splitlines():
        if line.startswith(f'shardcache_manifest_loads_total{{origin="{origin}"}}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


@pytest.mark.parametrize(
    "spelling",
    ["file://{dir}/./data%20set.parquet", "file://{dir}/sub/../data%20set.parquet"],
)
def test_a_second_sidecar_of_a_single_file_source_takes_the_kept_manifest(
    sidecar_factory: Factory, tmp_path: Path, spelling: str
) -> None:
    (tmp_path / "sub").mkdir()
    pq.write_table(datasets.make_table(0, 120), tmp_path / "data set.parquet")
    uri = spelling.format(dir=tmp_path)
    digest = manifests.resolve(uri).digest
    env = {
        contract.ENV_MANIFEST_DIGEST: digest,
        contract.ENV_SOURCE_FORMAT: "parquet",
        contract.ENV_DISK_DIR: str(tmp_path / "node-disk"),
    }

    first = sidecar_factory(uri, env=env)
    first.start(wait="ready")
    assert loads(first, "source") == 1 and loads(first, "node") == 0
    first.stop()

    second = sidecar_factory(uri, env=env)
    second.start(wait="ready")
    assert loads(second, "node") == 1 and loads(second, "source") == 0
    assert "is not usable" not in second.log_tail()
