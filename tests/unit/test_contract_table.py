"""The contract table is the one definition of every shared variable.

Held here against everything that restates it: the CRD's defaults and bounds, the spec
model, the docs' tables, the env the webhook writes, and the variables the sidecar and
its checkpoint agent read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardcache_operator import injection, pod_env, specs
from shardcache_sidecar import configuration
from shardcache_sidecar.checkpoint import agent_config

from shardcache import contract, errors
from shardcache.contract import parsers, variables

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SPEC_ROWS = [v for v in variables.TABLE if v.spec_field is not None]


def crd_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "datasetmount.yaml").read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]  # type: ignore[no-any-return]


def crd_field(path: str) -> dict[str, Any]:
    node = crd_spec_schema()
    for name in path.split("."):
        node = node["properties"][name]
    return node


def markdown_rows(path: Path, header: str) -> list[list[str]]:
    """The rows of the table in `path` whose header line starts with `header`."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def default_text(variable: variables.Variable[Any]) -> str:
    """A default as the docs write it: bytes with their quantity, "—" for none."""
    if variable.default is None:
        return "—"
    if variable.parser is parsers.BYTES:
        return f"{variable.default} ({parsers.quantity(variable.default)})"
    return parsers.render(variable.default)


def spec_text(variable: variables.Variable[Any]) -> str:
    if variable.spec_field is None:
        return "—"
    text = f"`{variable.spec_field}`"
    if variable.spec_default is not variables.SAME:
        value = variable.spec_default
        text += " (no default)" if value is None else f" (default {parsers.render(value)})"
    return text


def names(members: frozenset[Any]) -> str:
    ordered = [m.value for m in (*variables.Reader, *variables.Container) if m in members]
    return ", ".join(dict.fromkeys(ordered)) or "—"


@pytest.mark.parametrize("variable", SPEC_ROWS, ids=lambda v: v.env)
def test_crd_default_and_bounds_are_the_tables(variable: variables.Variable[Any]) -> None:
    assert variable.spec_field is not None
    field = crd_field(variable.spec_field)
    expected = variable.spec_value_default
    if expected is None:
        assert "default" not in field
    elif variable.parser is parsers.BYTES:
        assert field["default"] == parsers.quantity(expected)
    else:
        assert field["default"] == expected
    assert field.get("minimum") == variable.parser.minimum
    assert field.get("maximum") == variable.parser.maximum


@pytest.mark.parametrize("variable", SPEC_ROWS, ids=lambda v: v.env)
def test_spec_model_fills_in_the_tables_defaults(variable: variables.Variable[Any]) -> None:
    spec = specs.parse_spec({"source": {"uri": "s3://d/x/"}, "checkpoint": {"uri": "s3://c/r/"}})
    assert variable.spec_field is not None
    if variable.spec_field in ("source.uri", "checkpoint.uri"):
        return  # required: no default to compare
    assert pod_env.spec_value(spec, variable.spec_field) == variable.spec_value_default


def test_docs_table_lists_every_variable_as_the_code_defines_it() -> None:
    rows = markdown_rows(ROOT / "docs" / "wire-format.md", "| variable | type | default |")
    documented = {row[0].strip("`"): row for row in rows}
    assert sorted(documented) == sorted(v.env for v in variables.TABLE)
    for variable in variables.TABLE:
        _, kind, default, spec_field, readers, into, meaning = documented[variable.env]
        assert (kind, default, spec_field, readers, into, meaning) == (
            variable.parser.kind,
            default_text(variable),
            spec_text(variable),
            names(variable.readers),
            names(variable.injected),
            variable.doc,
        ), variable.env


def test_checkpoint_docs_table_shows_the_spec_defaults() -> None:
    rows = markdown_rows(ROOT / "docs" / "checkpoints.md", "| env (injected by the webhook)")
    documented = {row[0].strip("`"): row for row in rows if row[0] != "—"}
    checkpoint_rows = [
        v for v in variables.TABLE if v.env.startswith("SHARDCACHE_CHECKPOINT_") and v.injected
    ]
    assert sorted(documented) == sorted(v.env for v in checkpoint_rows)
    for variable in checkpoint_rows:
        _, field, default, _meaning = documented[variable.env]
        assert variable.spec_field == f"checkpoint.{field.strip('`')}"
        value = variable.spec_value_default
        if value is None:
            assert default == "—", variable.env
        elif variable.parser is parsers.BYTES:
            assert default == parsers.quantity(value), variable.env
        else:
            assert default == parsers.render(value), variable.env


def test_every_shared_env_name_is_one_row() -> None:
    envs = [v.env for v in variables.TABLE]
    assert len(envs) == len(set(envs))
    named = {
        value
        for key, value in vars(contract).items()
        if key.startswith("ENV_") and value.startswith("SHARDCACHE_")
    }
    assert named == set(envs)


FULL_SPEC = {
    "source": {"uri": "s3://data/x/", "format": "arrow", "secretRef": {"name": "s3"}},
    "sharding": {"blockSize": 512, "worldSize": 4, "rankFrom": "Fixed", "rank": 1},
    "checkpoint": {"uri": "s3://ckpt/run/"},
    "mixture": {"sources": [{"name": "code", "weight": 1, "uri": "s3://code/x/"}]},
}


def injected(spec: dict[str, Any], *, indexed: bool = False) -> dict[str, Any]:
    mount = injection.Mount("data", specs.parse_spec(spec), "sha256:" + "ab" * 32)
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "trainer"}]}}
    return injection.inject(
        pod, [mount], defaults=injection.SidecarDefaults(image="s:1"), indexed_job=indexed
    )


def rows_for(container: variables.Container) -> list[str]:
    return [v.env for v in variables.injected_into(container)]


def test_webhook_writes_exactly_the_rows_marked_for_each_container() -> None:
    pod = injected(FULL_SPEC)
    (sidecar,) = pod["spec"]["initContainers"]
    (trainer,) = pod["spec"]["containers"]
    assert [e["name"] for e in sidecar["env"]] == rows_for(variables.Container.SIDECAR)
    assert sorted(e["name"] for e in trainer["env"]) == sorted(
        rows_for(variables.Container.TRAINER)
    )


def test_indexed_job_rank_comes_from_the_downward_api_before_the_uri_using_it() -> None:
    spec = {**FULL_SPEC, "sharding": {"rankFrom": "JobCompletionIndex"}}
    (sidecar,) = injected(spec, indexed=True)["spec"]["initContainers"]
    order = [e["name"] for e in sidecar["env"]]
    rank = order.index(contract.ENV_RANK)
    assert "fieldRef" in sidecar["env"][rank]["valueFrom"]
    # The kubelet expands $(SHARDCACHE_RANK) only from variables defined before it.
    assert rank < order.index(contract.ENV_CHECKPOINT_URI)


def test_every_value_the_webhook_writes_parses_with_its_readers_parser() -> None:
    (sidecar,) = injected(FULL_SPEC)["spec"]["initContainers"]
    for entry in sidecar["env"]:
        variables.BY_ENV[entry["name"]].parse(entry["value"])


def test_readers_column_is_what_the_sidecar_and_agent_read() -> None:
    sidecar_reads = {option.variable.env for option in configuration.OPTIONS}
    assert sidecar_reads == {v.env for v in variables.read_by(variables.Reader.SIDECAR)}
    agent_reads = {v.env for v in agent_config.FIELDS.values()}
    agent_reads |= {contract.ENV_CHECKPOINT_URI, contract.ENV_CHECKPOINT_DIR}
    assert agent_reads == {v.env for v in variables.read_by(variables.Reader.AGENT)}


def test_sidecar_flags_are_one_per_variable_it_reads() -> None:
    flags = [option.flag for option in configuration.OPTIONS]
    assert len(flags) == len(set(flags))
    fields = [option.field for option in configuration.OPTIONS]
    assert len(fields) == len(set(fields))


@pytest.mark.parametrize(
    ("text", "value"),
    [(word, True) for word in ("true", "TRUE", "yes", "On", "1")]
    + [(word, False) for word in ("false", "No", "off", "0")],
)
def test_booleans_accept_one_documented_word_set(text: str, value: bool) -> None:
    assert variables.SHUFFLE.parse(text) is value


@pytest.mark.parametrize("text", ["ture", "enabled", "2", "y"])
def test_other_boolean_words_are_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(
        errors.InputError, match=re.escape("$SHARDCACHE_SHUFFLE: expected true or false")
    ):
        variables.SHUFFLE.get({contract.ENV_SHUFFLE: text})


@pytest.mark.parametrize(
    ("variable", "text", "message"),
    [
        (variables.PREFETCH_DEPTH, "1025", "expected an integer 0-1024, found 1025"),
        (variables.FETCH_CONCURRENCY, "-1", "expected an integer 0-256, found -1"),
        (variables.SEED, "1.5", "expected an integer, found '1.5'"),
        (variables.MEMORY_LIMIT, "2Gi", "expected a byte count >= 0, found '2Gi'"),
        (variables.RECONNECT_TIMEOUT, "0", "expected finite seconds > 0, found 0"),
        (variables.LOG_FORMAT, "xml", "expected json or text, found 'xml'"),
        (variables.MANIFEST_DIGEST, "md5:1", "expected 'sha256:<hex>', found 'md5:1'"),
    ],
    ids=lambda x: x.env if isinstance(x, variables.Variable) else None,
)
def test_bad_values_name_the_variable_the_expectation_and_the_value(
    variable: variables.Variable[Any], text: str, message: str
) -> None:
    with pytest.raises(errors.InputError, match=re.escape(f"${variable.env}: {message}")):
        variable.get({variable.env: text})


def test_unset_and_empty_take_the_default() -> None:
    assert variables.PREFETCH_DEPTH.read({}) == variables.PREFETCH_DEPTH.default
    assert variables.PREFETCH_DEPTH.read({contract.ENV_PREFETCH_DEPTH: " "}) == 4
    assert variables.PREFETCH_DEPTH.get({}) is None


def test_launcher_env_is_checked_against_the_table() -> None:
    env = variables.environ([(variables.SHUFFLE, False), (variables.RUN_DIR, Path("/r"))])
    assert env == {contract.ENV_SHUFFLE: "false", contract.ENV_RUN_DIR: "/r"}
    with pytest.raises(errors.InputError, match=re.escape("$SHARDCACHE_METRICS_PORT")):
        variables.environ([(variables.METRICS_PORT, 70000)])
