"""`shardcache skip`, `lineage` and `diff` against a checkpoint store that fails: one
line naming the store's URI and exit status 2 (never `diff`'s 1, "the runs differ"),
transient errors retried as dataset reads are, permanent ones reported at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from shardcache import cli, source
from shardcache.checkpoint import layout
from shardcache.lineage import published
from tests.support import datasets

pytestmark = pytest.mark.unit

CKPT = "s3://ckpt/run"
UNREACHABLE = (
    "When listing objects under key 'run/' in bucket 'ckpt': AWS Error NETWORK_CONNECTION "
    "during ListObjectsV2 operation: curlCode: 7, Could not connect to server"
)
DENIED = (
    "When listing objects under key 'run/' in bucket 'ckpt': AWS Error ACCESS_DENIED "
    "during ListObjectsV2 operation: Access Denied"
)


class FailingStore:
    """An S3 filesystem whose every listing fails with `message`; counts the tries."""

    type_name = "s3"

    def __init__(self, message: str) -> None:
        self.message = message
        self.tries = 0

    def get_file_info(self, _: Any) -> Any:
        self.tries += 1
        raise OSError(self.message)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> FailingStore:
    failing = FailingStore(request.param)
    monkeypatch.setattr(published, "open_uri", lambda uri, **_: (failing, "ckpt/run"))
    # Three quick tries instead of a minute's.
    quick = source.RetryPolicy(attempts=3, initial_delay=0.001, max_delay=0.001)
    monkeypatch.setattr(published, "RETRY", quick)
    return failing


def commands(tmp_path: Path) -> dict[str, list[str]]:
    uri, _ = datasets.write_local(tmp_path / "ds", [40, 40])
    cache = str(tmp_path / "cache")
    return {
        "skip": ["skip", "--checkpoint-uri", CKPT, "--step", "10", "--batches", "3"],
        "lineage": ["lineage", uri, "--cache-dir", cache, "--checkpoint-uri", CKPT,
                    "--where", "uid == 1"],
        "diff": ["diff", uri, "--batch-size", "4", "--a-checkpoint-uri", CKPT],
    }  # fmt: skip


@pytest.mark.parametrize("command", ["skip", "lineage", "diff"])
@pytest.mark.parametrize("store", [UNREACHABLE], indirect=True)
def test_an_unreachable_checkpoint_store_is_retried_then_one_line_naming_it_exit_2(
    command: str, store: FailingStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(commands(tmp_path)[command])
    err = capsys.readouterr().err
    assert status == 2
    assert store.tries == 3
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"shardcache {command}: listing the checkpoint store {CKPT}: ")
    assert "failed after 3 attempts" in last and "NETWORK_CONNECTION" in last
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["skip", "lineage", "diff"])
@pytest.mark.parametrize("store", [DENIED], indirect=True)
def test_a_store_refusing_the_credentials_fails_at_once_in_one_line(
    command: str, store: FailingStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(commands(tmp_path)[command])
    err = capsys.readouterr().err
    assert status == 2
    assert store.tries == 1
    assert err.count("\n") == 1 and err.startswith(f"shardcache {command}: ")
    assert CKPT in err and "ACCESS_DENIED" in err


def test_skip_retries_its_writes_and_a_delete_whose_answer_was_lost_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardcache.lineage import skip

    fs = pafs.LocalFileSystem()
    prefix = str(tmp_path)
    for step in (10, 20):
        manifest = layout.CheckpointManifest(
            step=step, name=f"step-{step}", files=(), data_state=None, created_at=0.0
        )
        layout.write_json(fs, layout.manifest_path(prefix, step), manifest.to_json())
    request = layout.SkipRequest(step=10, batches=1, batch_size=4)
    planned = [skip.Planned(prefix, None, request, None, (20,))]  # type: ignore[arg-type]

    class Flaky(pafs.LocalFileSystem):
        """Deletes, then says the connection was reset."""

        failed = False

        def delete_file(self, path: str) -> None:
            super().delete_file(path)
            if not Flaky.failed:
                Flaky.failed = True
                raise OSError("Connection reset by peer")

    monkeypatch.setattr(published, "RETRY", source.RetryPolicy(initial_delay=0.001))
    skip.apply(Flaky(), planned)
    assert Flaky.failed
    assert layout.read_json(fs, layout.manifest_path(prefix, 20)) is None
    assert layout.read_json(fs, layout.discarded_path(prefix, 20)) is not None
    assert layout.read_skip_request(fs, prefix, 10) == request
