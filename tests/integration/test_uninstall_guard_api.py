"""The uninstall guard's API client against an HTTP server answering as an API server
would: every page of a long list is read, a missing CRD (404) is no mount, a refusal
(403) is not tried again, and a server error is tried again before the guard refuses.
(The real API server and the operator's identity: tests/e2e/test_uninstall_guard.py.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from shardcache_operator import uninstall_guard

pytestmark = pytest.mark.integration


class Api:
    def __init__(self) -> None:
        #: Answers in turn: (status, body); the last one repeats.
        self.answers: list[tuple[int, object]] = []
        self.paths: list[str] = []


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[Api, Path]]:
    state = Api()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.paths.append(self.path)
            status, body = state.answers.pop(0) if len(state.answers) > 1 else state.answers[0]
            if callable(body):
                body = body(parse_qs(urlparse(self.path).query))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    try:
        yield state, kubeconfig
    finally:
        server.shutdown()
        server.server_close()


def page(query: dict[str, list[str]]) -> dict[str, object]:
    """Two pages: the first says where to go on."""
    if "continue" not in query:
        return {"metadata": {"continue": "next"},
                "items": [{"metadata": {"namespace": "a", "name": "one"}}]}  # fmt: skip
    return {"metadata": {}, "items": [{"metadata": {"namespace": "b", "name": "two"}}]}


def guard(kubeconfig: Path, tmp_path: Path, *args: str) -> tuple[int, str]:
    log = tmp_path / "termination-log"
    code = uninstall_guard.main(
        [f"--kubeconfig={kubeconfig}", *args], termination_log=str(log), sleep=lambda s: None
    )
    return code, log.read_text() if log.exists() else ""


def test_every_page_of_the_list_is_read(api: tuple[Api, Path], tmp_path: Path) -> None:
    state, kubeconfig = api
    state.answers = [(200, page)]
    code, said = guard(kubeconfig, tmp_path)
    assert code == 1
    assert "  a/one (no phase yet)" in said and "  b/two (no phase yet)" in said
    assert [p.split("?")[0] for p in state.paths] == [
        "/apis/shardcache.io/v1alpha1/datasetmounts"
    ] * 2


def test_a_namespace_is_listed_by_its_own_path(api: tuple[Api, Path], tmp_path: Path) -> None:
    state, kubeconfig = api
    state.answers = [(200, {"metadata": {}, "items": []})]
    code, _ = guard(kubeconfig, tmp_path, "--namespace=team-a")
    assert code == 0
    (path,) = state.paths
    assert path.startswith("/apis/shardcache.io/v1alpha1/namespaces/team-a/datasetmounts?")


def test_no_crd_is_no_mount(api: tuple[Api, Path], tmp_path: Path) -> None:
    state, kubeconfig = api
    state.answers = [(404, {"kind": "Status", "reason": "NotFound"})]
    assert guard(kubeconfig, tmp_path) == (0, "")


def test_a_refusal_is_said_at_once(api: tuple[Api, Path], tmp_path: Path) -> None:
    state, kubeconfig = api
    state.answers = [(403, {"kind": "Status", "message": "datasetmounts is forbidden"})]
    code, said = guard(kubeconfig, tmp_path)
    assert code == 1
    assert len(state.paths) == 1
    assert "HTTP 403" in said and "datasetmounts is forbidden" in said


def test_a_server_error_is_tried_again(api: tuple[Api, Path], tmp_path: Path) -> None:
    state, kubeconfig = api
    state.answers = [(503, {"kind": "Status"}), (200, {"metadata": {}, "items": []})]
    code, said = guard(kubeconfig, tmp_path)
    assert (code, said) == (0, "")
    assert len(state.paths) == 2


def test_an_api_that_does_not_answer_refuses_the_uninstall_saying_so(
    api: tuple[Api, Path], tmp_path: Path
) -> None:
    _, kubeconfig = api
    closed = kubeconfig.read_text().replace("http://127.0.0.1:", "http://127.0.0.1:1#")
    (tmp_path / "closed").write_text(closed)
    code, said = guard(tmp_path / "closed", tmp_path)
    assert code == 1
    assert said.startswith("helm uninstall refused: the guard could not tell whether"), said
    assert "listing DatasetMounts in every namespace failed" in said
