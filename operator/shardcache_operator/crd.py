"""Generate the DatasetMount CRD from the spec model (`shardcache_operator.specs`) and status schema.

`make crds` writes the result to crds/datasetmount.yaml; a unit test checks that the
committed file equals `render()`, so the model stays the one source of truth.

    python -m shardcache_operator.crd > crds/datasetmount.yaml
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from shardcache_operator import specs, status

HEADER = (
    "# Generated from shardcache_operator/specs.py and shardcache_operator/status.py by `make crds`.\n"
    "# Do not edit by hand: change the model and regenerate.\n"
)


#: Annotation of the generated CRD: its schema version, which the operator compares
#: with its own before it reconciles (`crd_version`) and the chart before an upgrade
#: (templates/checks/crds.yaml). helm installs crds/ on first install only, so an upgrade
#: may leave an older CRD whose schema prunes what a newer operator writes.
ANNOTATION_SCHEMA_VERSION = "shardcache.io/schema-version"
#: Bump with every change of what the API server accepts, defaults, stores or prunes
#: (not for a description): SCHEMA_FINGERPRINT records which schema this version is,
#: and tests/unit/test_crd.py fails until both are set. Bump the chart's version too
#: (helm/shardcache/Chart.yaml).
SCHEMA_VERSION = 3
SCHEMA_FINGERPRINT = "sha256:1daabe73b7d50736c0d58d0a28507a3cc8761d882d48feea1b31f2fd329e0bbd"


def _without_descriptions(node: object) -> object:
    if isinstance(node, Mapping):
        return {
            key: _without_descriptions(value)
            for key, value in node.items()
            if not (key == "description" and isinstance(value, str))
        }
    if isinstance(node, list):
        return [_without_descriptions(item) for item in node]
    return node


def fingerprint(crd: Mapping[str, Any]) -> str:
    """sha256 of the CRD's spec without its descriptions: what the API server enforces."""
    text = json.dumps(_without_descriptions(crd["spec"]), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _schema_default(value: object) -> object:
    return dict(value) if isinstance(value, dict) else value


def field_schema(kind: Any, info: specs.FieldInfo) -> dict[str, Any]:
    """The OpenAPI schema of one model field."""
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        schema = object_schema(kind, description=info.description)
    elif typing.get_origin(kind) is tuple:
        (item,) = (a for a in typing.get_args(kind) if a is not Ellipsis)
        schema = {"type": "array", "description": info.description, "items": object_schema(item)}
        if info.min_items is not None:
            schema["minItems"] = info.min_items
        if info.max_items is not None:
            schema["maxItems"] = info.max_items
    elif info.quantity:
        schema = {
            "description": info.description,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": specs.QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
            # A structural int-or-string allows no minimum; the pattern covers strings.
            "x-kubernetes-validations": [
                {"rule": rule.cel, "message": rule.message} for rule in specs.QUANTITY_RULES
            ],
        }
    elif info.resource_map:
        schema = {
            "type": "object",
            "description": info.description,
            # Bounded, so the API server's CEL cost estimate for the values stays small.
            "maxProperties": 16,
            "additionalProperties": {
                "description": "A quantity: cpu in cores or millicores, memory in bytes.",
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "pattern": specs.RESOURCE_QUANTITY_PATTERN,
                "x-kubernetes-int-or-string": True,
                "x-kubernetes-validations": [
                    {"rule": rule.cel, "message": rule.message} for rule in specs.QUANTITY_RULES
                ],
            },
        }
    elif kind is bool:
        schema = {"type": "boolean", "description": info.description}
    elif kind is int:
        schema = {"type": "integer", "format": "int64", "description": info.description}
        if info.minimum is not None:
            schema["minimum"] = info.minimum
        if info.maximum is not None:
            schema["maximum"] = info.maximum
    elif kind is str:
        schema = {"type": "string", "description": info.description}
        if info.enum is not None:
            schema["enum"] = list(info.enum)
        if info.pattern is not None:
            schema["pattern"] = info.pattern
        if info.max_length is not None:
            schema["maxLength"] = info.max_length
    else:
        raise TypeError(f"{info.json}: no schema for model type {kind!r}")
    if info.schema_default is not None:
        schema["default"] = _schema_default(info.schema_default)
    return schema


def object_schema(cls: type[Any], *, description: str | None = None) -> dict[str, Any]:
    """The OpenAPI schema of a model dataclass, with its cross-field CEL rules."""
    kinds = specs.field_types(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for field in dataclasses.fields(cls):
        info = specs.field_info(field)
        kind, _optional = kinds[field.name]
        properties[info.json] = field_schema(kind, info)
        if info.required:
            required.append(info.json)
        elif dataclasses.is_dataclass(kind) and field.default_factory is not dataclasses.MISSING:
            # An empty object default makes the API server fill in the nested defaults.
            properties[info.json]["default"] = {}
    schema: dict[str, Any] = {
        "type": "object",
        "description": description or (cls.__doc__ or "").strip(),
        "properties": properties,
    }
    if required:
        schema["required"] = required
    rules = getattr(cls, "rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [
            {"rule": rule.cel, "message": rule.message} for rule in rules
        ]
    return schema


def build() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    root: dict[str, Any] = {
        "type": "object",
        "description": "A dataset in object storage, cached on the node next to training pods "
        "that carry the label shardcache.io/mount: <name>.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "shardcache.io/v1alpha1"},
            "kind": {"type": "string", "description": "DatasetMount"},
            # The API server allows nothing but the type here (and name rules at the root).
            "metadata": {"type": "object"},
            "spec": object_schema(specs.DatasetMountSpec),
            "status": status.schema(),
        },
        "x-kubernetes-validations": [
            {"rule": rule.cel, "message": rule.message} for rule in specs.ROOT_RULES
        ],
    }
    columns = [
        ("Phase", "string", ".status.phase", "Pending, Ready, Degraded, Invalid or Terminating."),
        ("Shards", "integer", ".status.shards", "Shards in the pinned manifest."),
        ("Size", "string", ".status.size", "Bytes of the pinned dataset at the source."),
        ("Pods", "integer", ".status.attachedPods", "Running pods that use this mount."),
        ("Age", "date", ".metadata.creationTimestamp", "Time since creation."),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{specs.PLURAL}.{specs.GROUP}",
            "annotations": {ANNOTATION_SCHEMA_VERSION: str(SCHEMA_VERSION)},
        },
        "spec": {
            "group": specs.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": specs.KIND,
                "listKind": f"{specs.KIND}List",
                "plural": specs.PLURAL,
                "singular": specs.SINGULAR,
                "shortNames": list(specs.SHORT_NAMES),
                "categories": ["shardcache"],
            },
            "versions": [
                {
                    "name": specs.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": name, "type": kind, "jsonPath": path, "description": text}
                        for name, kind, path, text in columns
                    ],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render() -> str:
    """The CRD as committed in crds/datasetmount.yaml."""
    return HEADER + yaml.safe_dump(build(), sort_keys=False, width=100)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
