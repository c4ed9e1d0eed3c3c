"""The committed CRD is what the model generates, and it accepts/rejects what the model does."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from shardcache_operator import configuration, crd, specs

from shardcache import errors

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "datasetmount.yaml"


def committed_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def committed_schema() -> dict[str, Any]:
    return committed_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def example_datasetmounts() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "DatasetMount":
                found.append((f"{path.name}:{doc['metadata']['name']}", doc))
    return found


EXAMPLES = example_datasetmounts()


def minimal(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"source": {"uri": "s3://bucket/prefix/"}}
    body.update(spec)
    return {
        "apiVersion": "shardcache.io/v1alpha1",
        "kind": "DatasetMount",
        "metadata": {"name": "data"},
        "spec": body,
    }


def test_committed_crd_equals_generated_output() -> None:
    assert CRD_PATH.read_text() == crd.render(), "run `make crds` and commit the result"


def test_a_schema_change_bumps_the_schema_version() -> None:
    """The operator refuses to reconcile against an installed CRD of a lower schema
    version (`crd_version`), so every change of what the API server enforces must bump
    it, or an upgrade that skipped the CRDs would go unnoticed again."""
    found = crd.fingerprint(crd.build())
    assert found == crd.SCHEMA_FINGERPRINT, (
        f"the CRD's schema changed (fingerprint {found}): bump crd.SCHEMA_VERSION (now "
        f"{crd.SCHEMA_VERSION}), set crd.SCHEMA_FINGERPRINT to {found!r}, bump the chart's "
        "version (helm/shardcache/Chart.yaml) and run `make crds`"
    )


def test_descriptions_are_not_part_of_the_schema_fingerprint() -> None:
    changed = copy.deepcopy(crd.build())
    spec = changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["description"] = "reworded"
    assert crd.fingerprint(changed) == crd.fingerprint(crd.build())
    spec["properties"]["cache"]["properties"]["nodePath"]["default"] = "/var/cache/shardcache"
    assert crd.fingerprint(changed) != crd.fingerprint(crd.build())


def test_condition_descriptions_name_every_condition_type() -> None:
    status = committed_schema()["properties"]["status"]["properties"]
    conditions = status["conditions"]
    for kind in conditions["items"]["properties"]["type"]["enum"]:
        assert kind in conditions["description"]
        assert kind in conditions["items"]["properties"]["type"]["description"]


def test_node_path_has_no_crd_default_so_the_platform_default_applies() -> None:
    """A default the API server fills in is stored as if the author wrote it: the
    operator could not tell a mount that left nodePath out from one that asked for
    /var/cache/shardcache, and a platform whose nodeCache.path is elsewhere refused
    every mount that left it out (the helm exploration's defect 3)."""
    cache = committed_schema()["properties"]["spec"]["properties"]["cache"]["properties"]
    assert "default" not in cache["nodePath"]
    assert specs.parse_spec({"source": {"uri": "s3://b/p/"}}).cache.node_path is None


def test_crd_identity_matches_the_issue() -> None:
    body = committed_crd()["spec"]
    assert body["group"] == "shardcache.io"
    assert body["scope"] == "Namespaced"
    assert body["names"]["kind"] == "DatasetMount"
    assert body["names"]["shortNames"] == ["dsm"]
    version = body["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Shards", "Size", "Pods", "Age"]


def _walk(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path, schema)]
    for name, child in (schema.get("properties") or {}).items():
        nodes += _walk(child, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        nodes += _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        nodes += _walk(schema["additionalProperties"], f"{path}{{}}")
    return nodes


def test_every_schema_field_has_a_description() -> None:
    # metadata is the one exception: the API server allows nothing but its type.
    missing = [
        path
        for path, node in _walk(committed_schema(), "")
        if not node.get("description") and path != ".metadata"
    ]
    assert missing == []


def test_schema_is_structural_every_field_has_a_type() -> None:
    # Structural schemas need a type everywhere, except int-or-string fields.
    untyped = [
        path
        for path, node in _walk(committed_schema(), "")
        if "type" not in node and not node.get("x-kubernetes-int-or-string")
    ]
    assert untyped == []


def test_required_spec_fields_keep_their_names() -> None:
    source = committed_schema()["properties"]["spec"]["properties"]["source"]
    assert source["required"] == ["uri"]
    assert set(source["properties"]) >= {"uri", "format", "secretRef", "version"}
    assert source["properties"]["format"]["enum"] == ["parquet", "arrow", "jsonl"]
    assert source["properties"]["secretRef"]["properties"]["name"]["type"] == "string"


@pytest.mark.parametrize("doc", [doc for _, doc in EXAMPLES], ids=[i for i, _ in EXAMPLES])
def test_example_datasetmount_is_valid_against_committed_schema(doc: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(committed_schema()).validate(doc)
    specs.load(doc)  # and against the model


def test_examples_include_at_least_one_datasetmount() -> None:
    assert len(EXAMPLES) >= 1


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"source": {"uri": "not a uri"}}, "uri"),
        ({"source": {"uri": "s3://b/", "format": "csv"}}, "format"),
        ({"cache": {"memory": "-1Gi"}}, "memory"),
        ({"cache": {"disk": -5}}, "disk"),
        ({"sidecar": {"resources": {"limits": {"memory": -1}}}}, "limits"),
        ({"prefetch": {"depth": -1}}, "depth"),
        ({"source": {"uri": "s3://b/", "version": "md5:abc"}}, "version"),
        ({"checkpoint": {"uri": "s3://c/", "restore": "yesterday"}}, "restore"),
        ({"source": {"format": "parquet"}}, "uri"),
    ],
)
def test_invalid_spec_is_rejected_by_schema_and_model(spec: dict[str, Any], where: str) -> None:
    doc = minimal()
    for key, value in spec.items():
        doc["spec"][key] = value
    schema_errors = list(jsonschema.Draft7Validator(committed_schema()).iter_errors(doc))
    failed_rules = [path for path, rule in CEL_RULES if not _holds(rule["rule"], doc, path)]
    assert schema_errors or failed_rules, "the API server would accept it"
    with pytest.raises(errors.InputError, match=where):
        specs.load(doc)


def _rules(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, str]]]:
    found = [(path, rule) for rule in schema.get("x-kubernetes-validations", [])]
    for name, child in (schema.get("properties") or {}).items():
        found += _rules(child, f"{path}.{name}" if path else name)
    if isinstance(schema.get("additionalProperties"), dict):
        found += _rules(schema["additionalProperties"], f"{path}.*")
    return found


CEL_RULES = _rules(committed_schema(), "")


def _evaluate(rule: str, value: Any) -> bool:
    env = celpy.Environment()
    program = env.program(env.compile(rule))
    return bool(program.evaluate({"self": celpy.json_to_cel(value)}))


def _at(doc: Any, path: str) -> list[Any]:
    """Values at a dotted path ('*' = every map value); none when the path is absent."""
    values = [doc]
    for part in filter(None, path.split(".")):
        nxt: list[Any] = []
        for value in values:
            if not isinstance(value, dict):
                continue
            if part == "*":
                nxt += list(value.values())
            elif part in value:
                nxt.append(value[part])
        values = nxt
    return values


def _holds(rule: str, doc: dict[str, Any], path: str) -> bool:
    return all(_evaluate(rule, value) for value in _at(doc, path))


def _defaulted(doc: dict[str, Any]) -> dict[str, Any]:
    # The API server applies defaults before running CEL; the model's to_dict does the same.
    result = copy.deepcopy(doc)
    result["spec"] = specs.to_dict(specs.parse_spec(doc["spec"]))
    return result


def test_crd_has_cross_field_cel_rules_that_compile() -> None:
    assert len(CEL_RULES) >= 3
    env = celpy.Environment()
    for _, rule in CEL_RULES:
        env.compile(rule["rule"])
        assert rule["message"]


@pytest.mark.parametrize("doc", [doc for _, doc in EXAMPLES], ids=[i for i, _ in EXAMPLES])
def test_examples_satisfy_every_cel_rule(doc: dict[str, Any]) -> None:
    full = _defaulted(doc)
    for path, rule in CEL_RULES:
        assert _holds(rule["rule"], full, path), (path, rule)


SHARDINGS = [
    {},
    {"rankFrom": "Fixed", "rank": 1, "worldSize": 4},
    {"rankFrom": "Fixed", "rank": 4, "worldSize": 4},
    {"rankFrom": "Fixed", "worldSize": 4},
    {"rankFrom": "Fixed"},
    {"rankFrom": "Reader", "rank": 0, "worldSize": 2},
    {"rankFrom": "JobCompletionIndex", "worldSize": 8},
]


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_cel_rules_and_python_checks_agree(sharding: dict[str, Any]) -> None:
    rules = {rule["rule"]: rule["message"] for path, rule in CEL_RULES if path == "spec.sharding"}
    model_rules = {rule.cel: rule for rule in specs.ShardingSpec.rules}
    assert set(rules) == set(model_rules)
    values = {**specs.to_dict(specs.ShardingSpec()), **sharding}
    obj = specs.ShardingSpec(
        seed=values["seed"],
        shuffle=values["shuffle"],
        rank_from=values["rankFrom"],
        rank=values.get("rank"),
        world_size=values.get("worldSize"),
    )
    for cel, rule in model_rules.items():
        assert _evaluate(cel, values) == rule.check(obj), cel
    # And the model refuses exactly what CEL refuses.
    cel_ok = all(_evaluate(cel, values) for cel in rules)
    doc = minimal(sharding=sharding)
    if cel_ok:
        specs.load(doc)
    else:
        with pytest.raises(errors.InputError, match=r"spec\.sharding"):
            specs.load(doc)


def test_root_rule_limits_name_length_to_a_label_value() -> None:
    (root_rule,) = [rule for path, rule in CEL_RULES if path == ""]
    assert _evaluate(root_rule["rule"], {"metadata": {"name": "a" * 63}})
    assert not _evaluate(root_rule["rule"], {"metadata": {"name": "a" * 64}})
    with pytest.raises(errors.InputError, match="63"):
        specs.load({**minimal(), "metadata": {"name": "a" * 64}})


def test_kopf_peering_crds_match_what_kopf_looks_for() -> None:
    docs = list(yaml.safe_load_all((ROOT / "crds" / "kopf-peering.yaml").read_text()))
    names = {d["spec"]["names"]["plural"]: d for d in docs}
    assert set(names) == {"clusterkopfpeerings", "kopfpeerings"}
    for plural, doc in names.items():
        assert doc["apiVersion"] == "apiextensions.k8s.io/v1"
        assert doc["metadata"]["name"] == f"{plural}.kopf.dev"
        (version,) = doc["spec"]["versions"]
        assert version["name"] == "v1"
        # kopf patches peers into .status through the main resource.
        assert "subresources" not in version
        assert version["schema"]["openAPIV3Schema"]["x-kubernetes-preserve-unknown-fields"]
    peering = yaml.safe_load((ROOT / "examples" / "peering.yaml").read_text())
    assert (peering["apiVersion"], peering["kind"]) == ("kopf.dev/v1", "ClusterKopfPeering")
    assert peering["metadata"]["name"] == configuration.Settings().peering_name


@pytest.mark.parametrize("value", [-5, 0, 7, "2Gi", "500M"])
def test_quantity_cel_rule_agrees_with_python(value: Any) -> None:
    (rule,) = specs.QUANTITY_RULES
    assert _evaluate(rule.cel, value) == rule.check(value)
    paths = {path for path, r in CEL_RULES if r["rule"] == rule.cel}
    assert paths >= {"spec.cache.memory", "spec.cache.disk", "spec.checkpoint.size"}


def test_cel_rules_hold_on_the_defaults_the_api_server_checks() -> None:
    # The API server validates each default against its rules before filling nested
    # defaults: a rule must hold on an empty object.
    for path, rule in CEL_RULES:
        if path.startswith("spec.") and path.count(".") == 1:
            assert _evaluate(rule["rule"], {}), (path, rule)
