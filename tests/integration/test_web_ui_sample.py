"""The web inspector over a sample-mode run (`shardcache web --granularity sample
--checkpoint-uri`), through its JSON API and in a headless chromium: a step is the
batch the rank gathered (after its skips), and the lineage view's run plan leads back
to that step."""

from __future__ import annotations

import json
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.support import inspect_data, web_inspector

pytestmark = pytest.mark.integration

WORLD, SEED, BATCH, BLOCK, WINDOW = 2, 3, 6, 16, 45
Run = tuple[str, Path, Path, dict[int, list[list[int]]]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The dataset, its cache, the checkpoint store and each rank's handed-out batches
    (rank r skips 2 batches after its 3rd; checkpoints after batches 2 and 5)."""
    base = tmp_path_factory.mktemp("web-sample")
    uri = inspect_data.write(base / "ds").as_uri()
    store = base / "store"
    handed = web_inspector.record_run(
        uri, cache=base / "cache", store=store, world_size=WORLD, batch_size=BATCH,
        seed=SEED, block_size=BLOCK, shuffle="sample", window=WINDOW,
    )  # fmt: skip
    return uri, base / "cache", store, handed


@pytest.fixture(scope="module")
def server(run: Run, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    uri, cache, store, _ = run
    args = [uri, "--cache-dir", str(cache), "--checkpoint-uri", store.as_uri()]
    args += ["--batch-size", str(BATCH)]
    args += ["--world-size", str(WORLD), "--seed", str(SEED), "--block-size", str(BLOCK)]
    args += ["--granularity", "sample", "--window", str(WINDOW)]
    log = tmp_path_factory.mktemp("web-sample-log") / "stderr.log"
    with web_inspector.serving(args, log) as url:
        yield url


def test_a_step_is_the_batch_the_rank_gathered_after_its_skips(server: str, run: Run) -> None:
    handed = run[3]
    info = web_inspector.get_json(server, "/ui/api/info")
    assert (info["defaults"]["granularity"], info["defaults"]["window"]) == ("sample", WINDOW)
    for rank in range(WORLD):
        for step, batch in enumerate(handed[rank]):
            data = web_inspector.get_json(server, "/ui/api/step", rank=rank, step=step)
            assert [s["provenance"]["index"] for s in data["samples"]] == batch


def test_the_lineage_views_run_plan_leads_to_the_step_that_read_the_sample(
    server: str, run: Run
) -> None:
    handed = run[3]
    uid = handed[1][4][2]
    data = web_inspector.get_json(server, "/ui/api/lineage", expr=f"uid == {uid}")
    plan = data["run"]
    assert (plan["granularity"], plan["window"]) == ("sample", WINDOW)
    [read] = [r for r in data["reads"] if r["status"] == "read"]
    assert (read["rank"], read["step"], read["slot"]) == (1, 4, 2)
    # What the page's link asks for (app.js runParams).
    step = web_inspector.get_json(
        server, "/ui/api/step", epoch=read["epoch"], rank=read["rank"], step=read["step"],
        world_size=plan["world_size"], seed=plan["seed"], block_size=plan["block_size"],
        batch_size=plan["batch_size"], shuffle="true", granularity=plan["granularity"],
        window=plan["window"],
    )  # fmt: skip
    assert [s["provenance"]["index"] for s in step["samples"]] == handed[1][4]
    consumed = web_inspector.get_json(server, "/ui/api/lineage", consumed=5)
    for rank_report in consumed["ranks"]:
        got = sorted(
            i for e in rank_report["epochs"] for lo, hi in e["ranges"] for i in range(lo, hi)
        )
        assert got == sorted(u for batch in handed[rank_report["rank"]][2:] for u in batch)


def test_a_window_under_the_floor_or_an_unknown_granularity_is_refused(server: str) -> None:
    for params, message in (
        ({"window": 3}, "under the inspector's floor"),
        ({"granularity": "rows"}, "expected one of ['block', 'sample']"),
    ):
        with pytest.raises(urllib.error.HTTPError) as caught:
            web_inspector.get_json(server, "/ui/api/step", **params)
        assert caught.value.code == 400
        assert message in json.load(caught.value)["error"]


@pytest.mark.browser
def test_the_page_follows_a_sample_to_its_gathered_step(
    browser: object, server: str, run: Run
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    handed = run[3]
    uid = handed[1][4][2]
    driver: Any = browser
    driver.get(f"{server}/ui?granularity=block")
    box = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_element(By.CSS_SELECTOR, '#lineage-form input[name="expr"]')
    )
    WebDriverWait(driver, web_inspector.WAIT_S).until(lambda d: box.is_displayed())
    box.send_keys(f"uid == {uid}\n")
    link = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, '#lineage-results a[data-status="read"]')
    )[0]
    link.click()
    WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, f'article.sample[data-index="{uid}"]')
    )
    q = parse_qs(urlsplit(driver.current_url).query)
    # The link carries the run's mode, over the block view the page was opened with.
    assert (q["granularity"][0], int(q["window"][0])) == ("sample", WINDOW)
    assert (int(q["rank"][0]), int(q["step"][0])) == (1, 4)
    shown = [
        int(a.get_attribute("data-index"))
        for a in driver.find_elements(By.CSS_SELECTOR, "article.sample")
    ]
    assert shown == handed[1][4]
    select = driver.find_element(By.CSS_SELECTOR, 'select[name="granularity"]')
    assert select.get_attribute("value") == "sample"
