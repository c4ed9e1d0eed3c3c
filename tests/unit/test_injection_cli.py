"""`shardcache inject`: offline injection of multi-document YAML, and its errors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardcache_operator import configuration, injection, specs

from shardcache import cli, contract

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DSM = ROOT / "examples" / "datasetmount.yaml"
EXAMPLE_JOB = ROOT / "examples" / "training-job.yaml"

POD_SPEC = {"containers": [{"name": "main", "image": "python:3.11"}]}


def template(labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"labels": labels or {}}, "spec": copy.deepcopy(POD_SPEC)}


WORKLOADS = [
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": copy.deepcopy(POD_SPEC)},
    {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"template": template({"app": "d"})},
    },
    {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "s"},
        "spec": {"template": template()},
    },
    {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "j"},
        "spec": {"completionMode": "Indexed", "completions": 2, "template": template()},
    },
]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["inject", *args])
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, name: str, docs: list[Any] | str) -> str:
    path = tmp_path / name
    path.write_text(docs if isinstance(docs, str) else yaml.safe_dump_all(docs, sort_keys=False))
    return str(path)


def pod_of(doc: dict[str, Any]) -> dict[str, Any]:
    return doc if doc["kind"] == "Pod" else doc["spec"]["template"]


UID = "0b8f3a52-1c7e-4d3a-9f4e-2a6b5c7d8e9f"


def disk_subpaths(pod: dict[str, Any]) -> list[str]:
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c.get("restartPolicy") == "Always"]
    return [m["subPath"] for m in sidecar["volumeMounts"] if "subPath" in m]


def sidecar_env(pod: dict[str, Any]) -> dict[str, Any]:
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c.get("restartPolicy") == "Always"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in sidecar["env"]}


def test_example_job_is_injected_exactly_as_the_pure_function_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "-f", str(EXAMPLE_JOB), "--mount", str(EXAMPLE_DSM))
    assert code == 0
    (job,) = yaml.safe_load_all(out)
    original = yaml.safe_load(EXAMPLE_JOB.read_text())
    mount = specs.load(yaml.safe_load(EXAMPLE_DSM.read_text()))
    expected = injection.inject(
        original["spec"]["template"],
        [injection.Mount(mount.name, mount.spec, mount.manifest_digest, mount.namespace)],
        defaults=injection.SidecarDefaults(image=configuration.Settings().sidecar_image),
        indexed_job=True,
    )
    assert job["spec"]["template"] == expected
    assert {k: v for k, v in job.items() if k != "spec"} == {
        k: v for k, v in original.items() if k != "spec"
    }


def test_every_supported_kind_in_one_stream_gets_the_mount(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write(tmp_path, "workloads.yaml", WORKLOADS)
    code, out, err = run(capsys, "-f", source, "--mount", str(EXAMPLE_DSM))
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["Pod", "Deployment", "StatefulSet", "Job"]
    for doc in docs:
        pod = pod_of(doc)
        assert pod["metadata"]["labels"][injection.LABEL_MOUNT] == "imagenet-train"
        assert pod["metadata"]["annotations"][injection.ANNOTATION_INJECTED] == "imagenet-train"
        env = sidecar_env(pod)
        # Only the Indexed Job's pods learn their rank from the completion index.
        assert ("SHARDCACHE_RANK" in env) == (doc["kind"] == "Job")
    assert pod_of(docs[1])["metadata"]["labels"]["app"] == "d"
    assert "no pinned digest" in err


def test_injecting_injected_output_again_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write(tmp_path, "workloads.yaml", WORKLOADS)
    _, once, _ = run(capsys, "-f", source, "--mount", str(EXAMPLE_DSM))
    again = write(tmp_path, "once.yaml", once)
    code, twice, _ = run(capsys, "-f", again, "--mount", str(EXAMPLE_DSM))
    assert code == 0
    assert list(yaml.safe_load_all(twice)) == list(yaml.safe_load_all(once))


def test_pinned_digest_from_the_mount_file_reaches_the_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dsm = yaml.safe_load(EXAMPLE_DSM.read_text())
    dsm["status"] = {"phase": "Ready", "manifestDigest": "sha256:" + "1" * 64}
    mount = write(tmp_path, "dsm.yaml", [dsm])
    source = write(tmp_path, "pod.yaml", WORKLOADS[:1])
    code, out, err = run(
        capsys, "-f", source, "--mount", mount, "--namespace-uid", f"default={UID}"
    )
    assert code == 0 and err == ""
    env = sidecar_env(next(yaml.safe_load_all(out)))
    assert env["SHARDCACHE_MANIFEST_DIGEST"] == "sha256:" + "1" * 64


def test_checkpoint_agent_settings_from_the_mount_file_reach_the_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dsm = yaml.safe_load(EXAMPLE_DSM.read_text())
    dsm["spec"]["checkpoint"] = {
        "uri": "s3://ckpt/run/",
        "restoreFallback": True,
        "concurrency": 4,
        "verifyUploads": True,
        "uploadBuffer": "1Gi",
    }
    mount = write(tmp_path, "dsm.yaml", [dsm])
    source = write(tmp_path, "pod.yaml", WORKLOADS[:1])
    code, out, err = run(capsys, "-f", source, "--mount", mount)
    assert code == 0, err
    env = sidecar_env(next(yaml.safe_load_all(out)))
    assert env[contract.ENV_CHECKPOINT_RESTORE_FALLBACK] == "true"
    assert env[contract.ENV_CHECKPOINT_CONCURRENCY] == "4"
    assert env[contract.ENV_CHECKPOINT_VERIFY_UPLOADS] == "true"
    assert env[contract.ENV_CHECKPOINT_UPLOAD_BUFFER] == str(2**30)


def test_two_mount_files_and_a_label_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = yaml.safe_load(EXAMPLE_DSM.read_text())
    other["metadata"]["name"] = "captions"
    mount2 = write(tmp_path, "captions.yaml", [other])
    pod = copy.deepcopy(WORKLOADS[0])
    pod["metadata"]["labels"] = {injection.LABEL_MOUNT: "captions_imagenet-train"}
    source = write(tmp_path, "pod.yaml", [pod])
    code, out, _ = run(capsys, "-f", source, "--mount", str(EXAMPLE_DSM), "--mount", mount2)
    assert code == 0
    injected = next(yaml.safe_load_all(out))
    names = [c["name"] for c in injected["spec"]["initContainers"]]
    assert names == ["shardcache-captions", "shardcache-imagenet-train"]


@pytest.mark.parametrize(
    ("docs", "message"),
    [
        (
            [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "svc"}}],
            "document 1: cannot inject into kind 'Service'; expected one of Pod, Job",
        ),
        ("kind: Pod\nspec: [unclosed\n", "malformed YAML"),
        ("- just\n- a list\n", "document 1: expected a Kubernetes object"),
        (
            [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}}],
            "Deployment has no pod spec at spec.template",
        ),
        (
            [
                {
                    **WORKLOADS[0],
                    "metadata": {"name": "p", "labels": {injection.LABEL_MOUNT: "nope"}},
                }
            ],
            "asks for DatasetMount nope, which no --mount file defines",
        ),
    ],
)
def test_bad_input_documents_fail_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], docs: Any, message: str
) -> None:
    source = write(tmp_path, "in.yaml", docs)
    code, out, err = run(capsys, "-f", source, "--mount", str(EXAMPLE_DSM))
    assert code != 0
    assert out == ""
    assert message in err


def test_mount_file_that_is_not_a_datasetmount_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "-f", str(EXAMPLE_JOB), "--mount", str(EXAMPLE_JOB))
    assert code != 0 and out == ""
    assert "expected kind DatasetMount with apiVersion shardcache.io/v1alpha1" in err
    assert "found kind 'Job'" in err


def test_invalid_datasetmount_in_mount_file_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dsm = yaml.safe_load(EXAMPLE_DSM.read_text())
    dsm["spec"]["cache"]["memory"] = "-4Gi"
    mount = write(tmp_path, "dsm.yaml", [dsm])
    code, _, err = run(capsys, "-f", str(EXAMPLE_JOB), "--mount", mount)
    assert code != 0
    assert "spec.cache.memory" in err and "-4Gi" in err


def test_missing_input_file_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "-f", str(tmp_path / "absent.yaml"), "--mount", str(EXAMPLE_DSM))
    assert code != 0
    assert "absent.yaml" in err


def test_every_example_workload_injects_with_the_example_datasetmounts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    mounts = [
        str(p)
        for p in sorted((ROOT / "examples").glob("*.yaml"))
        if any(
            isinstance(d, dict) and d.get("kind") == "DatasetMount"
            for d in yaml.safe_load_all(p.read_text())
        )
    ]
    workloads = [
        p
        for p in sorted((ROOT / "examples").glob("*.yaml"))
        if any(
            isinstance(d, dict) and d.get("kind") in ("Pod", "Job", "Deployment", "StatefulSet")
            for d in yaml.safe_load_all(p.read_text())
        )
    ]
    assert len(workloads) >= 2
    for path in workloads:
        args = ["-f", str(path)] + [arg for m in mounts for arg in ("--mount", m)]
        code, out, err = run(capsys, *args)
        assert code == 0, (path.name, err)
        for doc in yaml.safe_load_all(out):
            pod = pod_of(doc)
            wanted = injection.requested_mounts(pod["metadata"])
            sidecars = [c for c in pod["spec"]["initContainers"] if c.get("restartPolicy")]
            assert [c["name"] for c in sidecars] == [f"shardcache-{m}" for m in wanted]


def test_an_output_file_it_cannot_write_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = tmp_path / "missing" / "out.yaml"
    code, out, err = run(
        capsys, "-f", str(EXAMPLE_JOB), "--mount", str(EXAMPLE_DSM), "-o", str(target)
    )
    assert code == 2 and out == ""
    last = err.splitlines()[-1]  # after the example's "no pinned digest" warning
    assert last == f"shardcache inject: cannot write {target}: No such file or directory"


@pytest.mark.parametrize("which", ["-f", "--mount"])
def test_a_file_that_is_not_utf8_is_named_and_exit_2(
    which: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("metadata: {name: caf\xe9}\n".encode("latin-1"))
    files = {"-f": str(EXAMPLE_JOB), "--mount": str(EXAMPLE_DSM), which: str(latin1)}
    code, out, err = run(capsys, "-f", files["-f"], "--mount", files["--mount"])
    assert code == 2 and out == ""
    assert err == (
        f"shardcache inject: {latin1}: expected UTF-8 YAML, found byte 0xe9 at offset 20 "
        "that is not UTF-8\n"
    )


def test_a_given_namespace_uid_keys_the_node_disk_directory_as_the_webhook_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write(tmp_path, "pod.yaml", WORKLOADS[:1])
    code, out, err = run(
        capsys, "-f", source, "--mount", str(EXAMPLE_DSM), "--namespace-uid", f"default={UID}"
    )
    assert code == 0 and "keyed by the name alone" not in err
    assert disk_subpaths(next(yaml.safe_load_all(out))) == [f"ns-default.{UID}"]


def test_without_the_namespace_uid_the_directory_is_keyed_by_name_and_a_warning_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write(tmp_path, "pods.yaml", WORKLOADS[:2])
    code, out, err = run(capsys, "-f", source, "--mount", str(EXAMPLE_DSM))
    assert code == 0
    assert [disk_subpaths(pod_of(d)) for d in yaml.safe_load_all(out)] == [["ns-default"]] * 2
    warned = [line for line in err.splitlines() if "keyed by the name alone" in line]
    assert len(warned) == 1 and "--namespace-uid default=" in warned[0], err


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("default", "expected NAMESPACE=UID, found 'default'"),
        (f"other={UID}", "expected the namespace of a --mount's DatasetMount (default), found 'other'"),
        ("default=NOT-A-UID", "expected metadata.uid to be a lowercase UUID"),
    ],
)  # fmt: skip
def test_a_bad_namespace_uid_is_named_and_exit_2(
    given: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write(tmp_path, "pod.yaml", WORKLOADS[:1])
    code, out, err = run(
        capsys, "-f", source, "--mount", str(EXAMPLE_DSM), "--namespace-uid", given
    )
    assert code == 2 and out == ""
    assert said in err, err
