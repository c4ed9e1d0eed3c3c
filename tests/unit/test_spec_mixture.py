"""spec.mixture: the model, its CEL rules, and the env the webhook gives the sidecar."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import celpy.adapter
import pytest
import yaml
from shardcache_operator import crd, injection, pod_env, specs

from shardcache import errors
from shardcache.contract import variables

pytestmark = pytest.mark.unit

DIGEST = "sha256:" + "ab" * 32
CODE_DIGEST = "sha256:" + "cd" * 32


def spec(mixture: dict[str, Any]) -> dict[str, Any]:
    return {"source": {"uri": "s3://data/web/"}, "mixture": mixture}


def mixture_rules() -> list[str]:
    schema = crd.build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    mixture = schema["properties"]["spec"]["properties"]["mixture"]
    return [rule["rule"] for rule in mixture["x-kubernetes-validations"]]


def evaluate(rule: str, value: Any) -> bool:
    env = celpy.Environment()
    return bool(env.program(env.compile(rule)).evaluate({"self": celpy.adapter.json_to_cel(value)}))


MIXTURES = [
    {"sources": [{"name": "code", "weight": 1, "uri": "s3://d/c/"}]},
    {"name": "web", "weight": 0, "sources": [{"name": "code", "weight": 2, "uri": "s3://d/c/"}]},
    {"sources": [{"name": "main", "weight": 1, "uri": "s3://d/c/"}]},
    {"name": "a", "sources": [{"name": "a", "weight": 1, "uri": "s3://d/c/"}]},
    {
        "sources": [
            {"name": "b", "weight": 1, "uri": "s3://d/b/"},
            {"name": "b", "weight": 1, "uri": "s3://d/c/"},
        ]
    },
    {"weight": 0, "sources": [{"name": "code", "weight": 0, "uri": "s3://d/c/"}]},
]


@pytest.mark.parametrize("mixture", MIXTURES)
def test_cel_rules_and_the_model_refuse_the_same_mixtures(mixture: dict[str, Any]) -> None:
    defaulted = {"name": "main", "weight": 1, "seed": 0, **mixture}
    cel_ok = all(evaluate(rule, defaulted) for rule in mixture_rules())
    if cel_ok:
        specs.parse_spec(spec(mixture))
    else:
        with pytest.raises(errors.InputError, match=r"spec\.mixture: "):
            specs.parse_spec(spec(mixture))


def test_the_cel_rules_hold_on_an_object_without_sources() -> None:
    # The API server checks rules on an object before its defaults are filled in.
    assert all(evaluate(rule, {}) for rule in mixture_rules())


def test_sources_are_a_bounded_list_of_checked_objects() -> None:
    with pytest.raises(errors.InputError, match=r"spec\.mixture\.sources: expected at least 1"):
        specs.parse_spec(spec({"sources": []}))
    with pytest.raises(errors.InputError, match=r"spec\.mixture\.sources\[0\]\.weight: expected"):
        specs.parse_spec(spec({"sources": [{"name": "c", "weight": -1, "uri": "s3://d/c/"}]}))
    with pytest.raises(errors.InputError, match=r"spec\.mixture\.sources\[0\]\.uri: required"):
        specs.parse_spec(spec({"sources": [{"name": "c", "weight": 1}]}))
    many = [{"name": f"s{i}", "weight": 1, "uri": "s3://d/c/"} for i in range(16)]
    with pytest.raises(errors.InputError, match="expected at most 15 items, found 16"):
        specs.parse_spec(spec({"sources": many}))


def test_the_sidecar_gets_every_source_with_its_weight_and_pin() -> None:
    parsed = specs.parse_spec(
        spec(
            {
                "name": "web",
                "weight": 3,
                "seed": 9,
                "sources": [{"name": "code", "weight": 1, "uri": "s3://data/code/"}],
            }
        )
    )
    mount = injection.Mount("mix", parsed, DIGEST, source_digests={"code": CODE_DIGEST})
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "trainer"}]}}
    out = injection.inject(pod, [mount], defaults=injection.SidecarDefaults(image="s:1"))
    (sidecar,) = out["spec"]["initContainers"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    mixture = variables.MIXTURE.parse(env[variables.MIXTURE.env])
    assert [(s.name, s.weight, s.uri, s.digest) for s in mixture.sources] == [
        ("web", 3, "s3://data/web/", DIGEST),
        ("code", 1, "s3://data/code/", CODE_DIGEST),
    ]
    assert mixture.seed == 9


def test_a_single_source_mount_gets_no_mixture() -> None:
    parsed = specs.parse_spec({"source": {"uri": "s3://data/web/"}})
    assert pod_env.mixture(parsed, digest=DIGEST, source_digests={}) is None


def test_load_reads_the_pinned_digests_of_the_further_sources() -> None:
    doc = yaml.safe_load(
        (Path(__file__).parents[2] / "examples" / "datasetmount-mixture.yaml").read_text()
    )
    doc["status"] = {
        "manifestDigest": DIGEST,
        "mixture": [{"name": "code", "manifestDigest": CODE_DIGEST}],
    }
    mount = specs.load(doc)
    assert mount.source_digests == {"code": CODE_DIGEST}
    assert mount.spec.mixture is not None and mount.spec.mixture.name == "web"
