"""`shardcache operator` and `shardcache inject` (plugins of the `shardcache` command)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from shardcache import errors
from shardcache.contract import log_levels
from shardcache_operator import configuration, injection, offline


def register_operator(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the DatasetMount operator and its pod webhook",
        description="Run the DatasetMount operator and its pod-injection webhook. Settings "
        "come from SHARDCACHE_OPERATOR_* variables; these flags override them.",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    parser.add_argument(
        "--namespace", action="append", dest="namespaces", help="serve only this namespace"
    )
    parser.add_argument("--standalone", action="store_true", default=None, help="no peering")
    parser.add_argument(
        "--priority", type=_flag("priority"), help="peering priority (default: random)"
    )
    parser.add_argument("--sidecar-image", help="default sidecar image")
    parser.add_argument("--no-webhook", dest="webhook_enabled", action="store_false", default=None)
    parser.add_argument("--webhook-addr", help="webhook listen address")
    parser.add_argument(
        "--webhook-port", type=_flag("webhook_port"), help="webhook listen port (0-65535)"
    )
    parser.add_argument("--webhook-host", help="host name in a managed webhook URL")
    parser.add_argument("--cert-file", dest="webhook_cert_file", help="serving certificate")
    parser.add_argument("--key-file", dest="webhook_key_file", help="serving key")
    parser.add_argument("--ca-file", dest="webhook_ca_file", help="CA bundle for caBundle")
    parser.add_argument(
        "--cert-dir", dest="webhook_cert_dir", help="where to write generated certs"
    )
    parser.add_argument(
        "--webhook-configuration",
        help="name of a MutatingWebhookConfiguration the operator manages (with caBundle)",
    )
    parser.add_argument("--health-addr", help="/healthz and /metrics listen address")
    parser.add_argument(
        "--health-port",
        type=_flag("health_port"),
        help="/healthz and /metrics listen port (0-65535)",
    )
    parser.add_argument(
        "--log-level",
        type=log_levels.PARSER.flag_type,
        default="INFO",
        help=f"LEVEL[,logger=LEVEL...], each LEVEL one of {log_levels.LEVEL_NAMES}, in any "
        "case (default: INFO; the chart's operator.logLevel)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging (--log-level DEBUG)")
    parser.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    root, loggers = log_levels.split("DEBUG" if args.verbose else args.log_level)
    logging.basicConfig(level=root, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, level in loggers.items():
        logging.getLogger(name).setLevel(level)
    overrides: dict[str, Any] = {
        key: getattr(args, key)
        for key in (
            "kubeconfig",
            "standalone",
            "priority",
            "sidecar_image",
            "webhook_enabled",
            "webhook_addr",
            "webhook_port",
            "webhook_host",
            "webhook_cert_file",
            "webhook_key_file",
            "webhook_ca_file",
            "webhook_cert_dir",
            "webhook_configuration",
            "health_addr",
            "health_port",
        )
    }
    if args.namespaces:
        overrides["namespaces"] = tuple(args.namespaces)
    try:
        settings = configuration.from_env(os.environ, **overrides)
    except errors.InputError as exc:
        print(f"shardcache operator: {exc}", file=sys.stderr)
        return 2
    from shardcache_operator import app, kube  # kopf and the API client load only here

    try:
        asyncio.run(app.run(settings))
    except kube.KubeconfigError as exc:
        # Raised before anything starts: one line naming the file, like a bad setting.
        print(f"shardcache operator: {exc}", file=sys.stderr)
        return 2
    return 0


def _flag(setting: str) -> Callable[[str], Any]:
    """argparse's `type=` for a flag of `setting`: the same parser and range as its env."""
    return configuration.parser(setting).flag_type


def register_inject(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "inject",
        help="inject DatasetMounts into Pod/Job/Deployment/StatefulSet YAML, offline",
        description="Write the documents of FILE with the given DatasetMounts injected into "
        "their pod templates, exactly as the webhook would. Pods that carry the "
        f"{injection.LABEL_MOUNT} label get the mounts they name; others get all of them.",
    )
    parser.add_argument("-f", "--filename", required=True, help="YAML file, or - for stdin")
    parser.add_argument(
        "--mount",
        action="append",
        required=True,
        metavar="DSM.yaml",
        help="a file with DatasetMount documents (repeatable)",
    )
    parser.add_argument("-o", "--output", help="output file (default: stdout)")
    parser.add_argument(
        "--sidecar-image",
        default=configuration.Settings.sidecar_image,
        help="sidecar image for mounts that name none",
    )
    parser.add_argument(
        "--namespace-uid",
        action="append",
        default=[],
        metavar="NAMESPACE=UID",
        help="the UID of a mount's namespace (`kubectl get namespace NAMESPACE -o "
        "jsonpath='{.metadata.uid}'`; repeatable): its node disk directory is then keyed "
        "by it, as the webhook keys it; without it, by the name alone (docs/security.md)",
    )
    parser.set_defaults(func=run_inject)


def _read_documents(path: str) -> list[object]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        # A ValueError, not an OSError: it would end in a traceback naming no file.
        where = "standard input" if path == "-" else path
        raise errors.InputError(
            f"{where}: expected UTF-8 YAML, found byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start} that is not UTF-8"
        ) from exc
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise errors.InputError(f"{path}: malformed YAML: {exc}") from exc


def run_inject(args: argparse.Namespace) -> int:
    try:
        mounts: dict[str, Any] = {}
        for path in args.mount:
            mounts.update(offline.load_mounts(_read_documents(path), source=path))
        uids = offline.namespace_uids(args.namespace_uid, mounts)
        documents = _read_documents(args.filename)
        for warning in offline.unkeyed(mounts, uids):
            print(f"shardcache inject: warning: {warning}", file=sys.stderr)
        defaults = injection.SidecarDefaults(image=args.sidecar_image)
        output: list[object] = []
        for index, doc in enumerate(documents, start=1):
            if doc is None:
                continue
            where = f"{args.filename}, document {index}"
            injected, warnings = offline.inject_document(
                doc, mounts, defaults=defaults, where=where, namespace_uids=uids
            )
            for warning in warnings:
                print(f"shardcache inject: warning: {warning}", file=sys.stderr)
            output.append(injected)
    except (errors.InputError, OSError) as exc:
        print(f"shardcache inject: {exc}", file=sys.stderr)
        return 2
    text = yaml.safe_dump_all(output, sort_keys=False)
    if not args.output:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as exc:
        print(
            f"shardcache inject: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr
        )
        return 2
    return 0
