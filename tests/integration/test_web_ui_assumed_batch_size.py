"""The web inspector says when the batch size it opens with is assumed.

`shardcache web URI` without `--batch-size` (and without `--checkpoint-uri`, whose
data states record the run's) opened at batch size 32 with nothing marking it as
assumed, while `shardcache inspect` says "batch size 32 is assumed": step N at another
batch size is other samples, so a page that shows the wrong ones must say why. The
sidecar's /ui never learns the trainer's batch size: assumed there too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shardcache_sidecar.ui import cli as web_cli
from shardcache_sidecar.ui import routes

from shardcache import cli, plans
from tests.support import inspect_data, web_inspector

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    base = tmp_path_factory.mktemp("web-assumed")
    return inspect_data.write(base / "ds").as_uri(), base / "cache"


def started_with(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> routes.Defaults:
    """The opening view `shardcache web <argv>` serves (the server itself left out)."""
    seen: list[routes.Defaults] = []

    async def serve(_insp: Any, defaults: routes.Defaults, *_args: Any) -> None:
        seen.append(defaults)

    monkeypatch.setattr(web_cli, "_serve", serve)
    assert cli.main(["web", *argv]) == 0
    [defaults] = seen
    return defaults


def test_web_without_a_batch_size_opens_at_an_assumed_one(
    data: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, cache = data
    defaults = started_with(monkeypatch, [uri, "--cache-dir", str(cache)])
    assert (defaults.batch_size, defaults.batch_size_from) == (32, "assumed")
    given = started_with(monkeypatch, [uri, "--cache-dir", str(cache), "--batch-size", "8"])
    assert (given.batch_size, given.batch_size_from) == (8, "--batch-size")


def test_the_sidecars_view_assumes_the_batch_size_it_never_learns() -> None:
    view = routes.Defaults.from_plan(plans.PlanParams(seed=3))
    assert (view.batch_size, view.batch_size_from) == (32, "assumed")
    assert routes.Defaults.from_plan(plans.PlanParams(), batch_size=4).batch_size_from == (
        "--batch-size"
    )


@pytest.fixture(scope="module")
def server(data: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    uri, cache = data
    log = tmp_path_factory.mktemp("web-assumed-log") / "stderr.log"
    with web_inspector.serving([uri, "--cache-dir", str(cache), "--seed", "3"], log) as url:
        yield url


def test_the_info_answer_says_the_batch_size_is_assumed(server: str) -> None:
    info = web_inspector.get_json(server, "/ui/api/info")
    assert info["defaults"]["batch_size"] == 32
    assert info["defaults"]["batch_size_from"] == "assumed"


@pytest.mark.browser
def test_the_page_marks_an_assumed_batch_size_until_another_is_chosen(
    browser: object, server: str
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver: Any = browser
    loaded = '#samples[data-loaded="0,0,0"]'
    driver.get(f"{server}/ui")
    WebDriverWait(driver, web_inspector.WAIT_S).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, loaded))
    )
    summary = driver.find_element(By.ID, "summary").text
    assert "batch size 32 is assumed (the default)" in summary, summary
    assert driver.find_element(By.ID, "batch-assumed").is_displayed()

    driver.get(f"{server}/ui?batch_size=8&step=1")
    WebDriverWait(driver, web_inspector.WAIT_S).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, '#samples[data-loaded="0,0,1"]'))
    )
    assert "assumed" not in driver.find_element(By.ID, "summary").text
    assert not driver.find_element(By.ID, "batch-assumed").is_displayed()
