"""The web inspector in a real headless chromium (Debian's), driven by selenium through
Debian's chromedriver: nothing downloads a browser. `shardcache web` runs as a real
process; what the page shows is checked against what `Dataset` yields."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from PIL import Image

import shardcache
from tests.support import inspect_data, web_inspector

pytestmark = [pytest.mark.integration, pytest.mark.browser]

WORLD, SEED, BATCH, BLOCK = 3, 11, 8, 16
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    base = tmp_path_factory.mktemp("web")
    return inspect_data.write(base / "ds").as_uri(), base / "cache"


@pytest.fixture(scope="module")
def server(data: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    uri, cache = data
    args = [uri, "--cache-dir", str(cache), "--world-size", str(WORLD), "--seed", str(SEED)]
    args += ["--batch-size", str(BATCH), "--block-size", str(BLOCK)]
    log = tmp_path_factory.mktemp("web-log") / "stderr.log"
    with web_inspector.serving(args, log) as url:
        yield url


def reader_uids(data: tuple[str, Path], *, rank: int, epoch: int, step: int) -> list[int]:
    uri, cache = data
    with shardcache.open(
        uri, cache_dir=cache, seed=SEED, rank=rank, world_size=WORLD, block_size=BLOCK
    ) as ds:
        ds.set_epoch(epoch)
        batches = list(ds.batches(BATCH))
    return [int(u) for u in batches[step].column("uid").to_pylist()]


def wait_loaded(driver: object, key: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, web_inspector.WAIT_S).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, f'#samples[data-loaded="{key}"]'))
    )


def shown_uids(driver: object) -> list[int]:
    from selenium.webdriver.common.by import By

    return [
        int(a.get_attribute("data-index"))
        for a in driver.find_elements(By.CSS_SELECTOR, "article.sample")  # type: ignore[attr-defined]
    ]


def test_shared_url_shows_the_ranks_step_with_thumbnails(
    browser: object, server: str, data: tuple[str, Path]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(f"{server}/ui?rank=1&step=3&epoch=1")  # type: ignore[attr-defined]
    wait_loaded(driver, "1,1,3")
    assert shown_uids(driver) == reader_uids(data, rank=1, epoch=1, step=3)
    summary = driver.find_element(By.ID, "summary").text  # type: ignore[attr-defined]
    assert "epoch 1 · rank 1 of 3 · step 3 of" in summary

    def thumbnails_loaded(d: object) -> list[object]:
        imgs = d.find_elements(By.CSS_SELECTOR, "img.thumb")  # type: ignore[attr-defined]
        return [
            i
            for i in imgs
            if d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", i)  # type: ignore[attr-defined]
        ]

    loaded = WebDriverWait(driver, web_inspector.WAIT_S).until(thumbnails_loaded)
    # Each thumbnail is the sample's own image, decoded by the browser at its size.
    for img in loaded:
        uid, width, height = driver.execute_script(  # type: ignore[attr-defined]
            "const i = arguments[0]; return [Number(i.closest('article').dataset.index),"
            " i.naturalWidth, i.naturalHeight]",
            img,
        )
        image = inspect_data.row(uid)["image"]
        assert isinstance(image, bytes)
        with Image.open(io.BytesIO(image)) as expected:
            assert (width, height) == expected.size

    ARTIFACTS.mkdir(exist_ok=True)
    # Wait for the statistics too, so the screenshot shows the whole page.
    WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#stats-body svg.hist rect")  # type: ignore[attr-defined]
    )
    shot = ARTIFACTS / "web-inspector.png"
    assert driver.save_screenshot(str(shot))  # type: ignore[attr-defined]
    assert shot.stat().st_size > 10_000


def test_next_step_button_updates_view_and_url(
    browser: object, server: str, data: tuple[str, Path]
) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"{server}/ui?rank=2&step=0")  # type: ignore[attr-defined]
    wait_loaded(driver, "0,2,0")
    driver.find_element(By.CSS_SELECTOR, 'button[data-move="step"][data-by="1"]').click()  # type: ignore[attr-defined]
    wait_loaded(driver, "0,2,1")
    assert shown_uids(driver) == reader_uids(data, rank=2, epoch=0, step=1)
    query = parse_qs(urlsplit(driver.current_url).query)  # type: ignore[attr-defined]
    assert (query["rank"], query["step"]) == (["2"], ["1"])
    # The last step of the epoch is a partial batch.
    driver.get(f"{server}/ui?rank=2&step=8")  # type: ignore[attr-defined]
    wait_loaded(driver, "0,2,8")
    last = reader_uids(data, rank=2, epoch=0, step=8)
    assert len(last) < BATCH
    assert shown_uids(driver) == last


def test_where_search_leads_to_the_step_holding_the_sample(
    browser: object, server: str, data: tuple[str, Path]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(f"{server}/ui")  # type: ignore[attr-defined]
    wait_loaded(driver, "0,0,0")
    box = driver.find_element(By.CSS_SELECTOR, '#where-form input[name="expr"]')  # type: ignore[attr-defined]
    box.send_keys("uid == 123\n")
    link = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#where-results a")  # type: ignore[attr-defined]
    )[0]
    link.click()
    WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, 'article.sample[data-index="123"]')  # type: ignore[attr-defined]
    )
    q = parse_qs(urlsplit(driver.current_url).query)  # type: ignore[attr-defined]
    rank, step = int(q["rank"][0]), int(q["step"][0])
    assert 123 in reader_uids(data, rank=rank, epoch=0, step=step)


def test_bad_step_shows_the_error_and_the_page_keeps_working(browser: object, server: str) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"{server}/ui?rank=0&step=999")  # type: ignore[attr-defined]
    wait_loaded(driver, "error")
    text = driver.find_element(By.ID, "status").text  # type: ignore[attr-defined]
    assert "step 999 is past the end of epoch 0 for rank 0" in text
    driver.get(f"{server}/ui?rank=0&step=1")  # type: ignore[attr-defined]
    wait_loaded(driver, "0,0,1")
