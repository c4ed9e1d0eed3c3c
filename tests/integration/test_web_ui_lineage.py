"""The web inspector's lineage view in a real headless chromium: `shardcache web
--checkpoint-uri` over a run whose ranks skipped batches; following a sample leads to
the step that read it, and that step is what the rank was handed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.support import inspect_data, web_inspector

pytestmark = [pytest.mark.integration, pytest.mark.browser]

WORLD, SEED, BATCH, BLOCK = 2, 3, 6, 16


@pytest.fixture(scope="module")
def run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, Path, Path, dict[int, list[list[int]]]]:
    """The dataset, its cache, the checkpoint store and each rank's handed-out batches
    (rank r skips 2 batches after step 3; checkpoints after steps 2 and 5)."""
    base = tmp_path_factory.mktemp("web-lineage")
    uri = inspect_data.write(base / "ds").as_uri()
    store = base / "store"
    handed = web_inspector.record_run(
        uri, cache=base / "cache", store=store, world_size=WORLD, batch_size=BATCH,
        seed=SEED, block_size=BLOCK,
    )  # fmt: skip
    return uri, base / "cache", store, handed


@pytest.fixture(scope="module")
def server(
    run: tuple[str, Path, Path, object], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    uri, cache, store, _ = run
    args = [uri, "--cache-dir", str(cache), "--checkpoint-uri", store.as_uri()]
    args += ["--batch-size", str(BATCH)]
    log = tmp_path_factory.mktemp("web-lineage-log") / "stderr.log"
    with web_inspector.serving(args, log) as url:
        yield url


def test_lineage_view_leads_to_the_step_the_rank_was_handed_after_a_skip(
    browser: object, server: str, run: tuple[str, Path, Path, dict[int, list[list[int]]]]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    handed = run[3]
    # A sample rank 1 read after its skip: step 4 of its epoch, inside checkpoint 5.
    uid = handed[1][4][2]
    driver = browser
    driver.get(f"{server}/ui")  # type: ignore[attr-defined]
    section = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_element(By.ID, "lineage")  # type: ignore[attr-defined]
    )
    WebDriverWait(driver, web_inspector.WAIT_S).until(lambda d: section.is_displayed())
    box = driver.find_element(By.CSS_SELECTOR, '#lineage-form input[name="expr"]')  # type: ignore[attr-defined]
    box.send_keys(f"uid == {uid}\n")
    link = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, '#lineage-results a[data-status="read"]')  # type: ignore[attr-defined]
    )[0]
    assert "in checkpoints 5" in link.text and "after checkpoint 2" in link.text
    link.click()
    WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, f'article.sample[data-index="{uid}"]')  # type: ignore[attr-defined]
    )
    q = parse_qs(urlsplit(driver.current_url).query)  # type: ignore[attr-defined]
    assert (int(q["rank"][0]), int(q["step"][0])) == (1, 4)
    shown = [
        int(a.get_attribute("data-index"))
        for a in driver.find_elements(By.CSS_SELECTOR, "article.sample")  # type: ignore[attr-defined]
    ]
    assert shown == handed[1][4], "the step view honours the run's skips"


def test_lineage_api_reports_skipped_samples_and_what_a_checkpoint_consumed(
    server: str, run: tuple[str, Path, Path, dict[int, list[list[int]]]]
) -> None:
    handed = run[3]
    report = web_inspector.get_json(server, "/ui/api/lineage?consumed=5")
    for rank_report in report["ranks"]:
        got = sorted(
            i for e in rank_report["epochs"] for lo, hi in e["ranges"] for i in range(lo, hi)
        )
        assert got == sorted(u for batch in handed[rank_report["rank"]][2:] for u in batch)
    data = web_inspector.get_json(server, "/ui/api/lineage?limit=1000&expr=uid%20%3E%3D%200")
    skipped = [r for r in data["reads"] if r["status"] == "skipped"]
    assert len(skipped) == WORLD * 2 * BATCH
    read = {r["index"] for r in data["reads"] if r["status"] == "read"}
    assert read == {u for batches in handed.values() for batch in batches for u in batch}
