"""A URI setting ($SHARDCACHE_SOURCE_URI, $SHARDCACHE_CHECKPOINT_URI, --source) must be
`scheme://…`: a mistyped scheme (`s3//bucket/run`) is refused at start, saying what was
expected, instead of being read as a relative local path (where the checkpoint agent
would publish every checkpoint, ready and silent). The contract is at least as strict
as the CRD's `uri` fields."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from shardcache_operator import specs
from shardcache_sidecar import configuration
from shardcache_sidecar.checkpoint import agent, agent_config

from shardcache import contract, errors, source
from shardcache.contract import parsers, variables

pytestmark = pytest.mark.unit

TYPOS = {
    "s3//bucket/run": "the scheme is not followed by '://'",
    "s3:/bucket/run": "the scheme is not followed by '://'",
    "file:/ckpt": "the scheme is not followed by '://'",
    "gs:bucket": "the scheme is not followed by '://'",
    "S3://bucket/run": "the scheme is written in lowercase (s3://)",
    "/data/run": "a local path: write it file:///data/run",
    "file://tmp/run": "which names a host: a local path is file:///absolute/path",
    "bucket/run": "'bucket/run'",
    "s3://": "'s3://'",
    "s3://b/" + "x" * 2048: "over the 2048 a URI may have",
}
GOOD = ["s3://bucket/run", "file:///ckpt", "gs://b/x", "hdfs://nn:8020/x", "abfs://c@acct/x"]


@pytest.mark.parametrize("variable", [variables.SOURCE_URI, variables.CHECKPOINT_URI])
@pytest.mark.parametrize(("value", "found"), TYPOS.items())
def test_a_uri_setting_without_scheme_slash_slash_is_refused_saying_what_was_expected(
    variable: variables.Variable[str], value: str, found: str
) -> None:
    with pytest.raises(errors.InputError) as info:
        variable.parse(value)
    message = str(info.value)
    assert message.startswith(f"${variable.env}: expected a URI scheme://path such as s3://")
    assert found in message


@pytest.mark.parametrize("value", GOOD)
def test_uris_of_every_scheme_form_are_taken(value: str) -> None:
    assert parsers.URI("$X", value) == value


def test_the_checkpoint_agents_settings_refuse_a_mistyped_scheme() -> None:
    env = {contract.ENV_CHECKPOINT_URI: "s3//bucket/run", contract.ENV_CHECKPOINT_DIR: "/ck"}
    with pytest.raises(errors.InputError, match=r"\$SHARDCACHE_CHECKPOINT_URI: expected a URI"):
        agent_config.CheckpointSettings.from_env(env)


def test_the_sidecars_settings_refuse_a_mistyped_source_scheme() -> None:
    with pytest.raises(errors.InputError, match=r"SOURCE_URI: expected a URI scheme://"):
        configuration.from_env({contract.ENV_SOURCE_URI: "s3//bucket/data"})


def test_the_uri_pattern_is_written_once_and_the_crd_uses_it() -> None:
    # A second copy (the operator kept one) drifts; the CRD's fields take the contract's.
    root = Path(__file__).resolve().parents[2]
    literal = "[a-z][a-z0-9+.-]*://"
    holders = [
        str(path.relative_to(root))
        for package in ("shardcache", "sidecar", "operator")
        for path in sorted((root / package).rglob("*.py"))
        if literal in path.read_text(encoding="utf-8")
    ]
    assert holders == ["shardcache/contract/parsers.py"]
    assert specs.MAX_URI_LENGTH == parsers.MAX_URI_LENGTH


def test_whatever_the_crd_pattern_refuses_the_contract_refuses() -> None:
    for value in [*TYPOS, *GOOD, "s3://b\nx", "3s://b/x", "s3 ://b"]:
        crd_takes = re.fullmatch(specs.URI_PATTERN, value) and len(value) <= specs.MAX_URI_LENGTH
        if not crd_takes:
            with pytest.raises(errors.InputError):
                parsers.URI("$X", value)


def test_a_file_uri_naming_a_host_is_refused_not_read_as_another_path() -> None:
    # file://tmp/data was read as /data.
    with pytest.raises(errors.InputError, match="names the host 'tmp': expected file:///"):
        source.split_uri("file://tmp/data")
    assert source.split_uri("file:///tmp/data") == ("file", "/tmp/data")


def test_a_uri_with_an_unclosed_ipv6_bracket_is_an_input_error_saying_what_was_expected() -> None:
    # urllib raised a bare ValueError, which no caller reports as the URI's fault.
    with pytest.raises(errors.InputError, match=r"not a well-formed URI .*\[address\]"):
        source.checked_uri("hdfs://[::1/data")


@pytest.mark.parametrize("uri", ["abfs://c@[fd00::5]:10000/p", "abfss://[::1]/c/p"])
def test_an_azure_uri_with_an_ipv6_host_is_refused_before_pyarrow_aborts_the_process(
    uri: str,
) -> None:
    # pyarrow's Azure client aborts the whole process on such a host (std::invalid_argument
    # out of C++): the sidecar, the operator's probe or the trainer would die, not fail.
    with pytest.raises(errors.InputError, match="IPv6 host, which pyarrow's Azure client"):
        source.filesystem(uri)


def test_the_agent_logs_where_it_publishes_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "ckpt").mkdir()
    settings = agent_config.CheckpointSettings.from_env(
        {
            contract.ENV_CHECKPOINT_URI: (tmp_path / "store").as_uri(),
            contract.ENV_CHECKPOINT_DIR: str(tmp_path / "ckpt"),
        }
    )
    assert settings is not None
    running = agent.Agent(settings)
    with caplog.at_level(logging.INFO, logger=agent.__name__):
        running.start()
        running.stop()
    assert (
        f"checkpoint agent: publishing what is committed under {tmp_path / 'ckpt'} to "
        f"{(tmp_path / 'store').as_uri()} (local filesystem, path {tmp_path / 'store'})"
    ) in caplog.messages
