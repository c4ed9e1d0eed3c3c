"""The web page in a real headless chromium over values a page gets wrong easily:
64-bit ids beyond 2^53 (a JSON number is a double in JavaScript) and a lookup that
stopped at its row budget (it must not say "no sample matches")."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shardcache_sidecar.ui import routes

from tests.support import web_inspector

pytestmark = [pytest.mark.integration, pytest.mark.browser]

BIG = 2**62 + 1
#: One shard past the lookup's row budget.
ROWS = routes.WHERE_SCAN_ROWS + 100


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("web-values")
    root = base / "ds"
    root.mkdir()
    uid = pa.array(range(BIG, BIG + ROWS), pa.int64())
    pq.write_table(pa.table({"uid": uid}), root / "one.parquet")
    args = [root.as_uri(), "--cache-dir", str(base / "cache"), "--batch-size", "4"]
    args += ["--no-shuffle"]
    with web_inspector.serving(args, base / "stderr.log") as url:
        yield url


def test_the_page_shows_64_bit_ids_exactly(browser: object, server: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(f"{server}/ui?rank=0&step=0")  # type: ignore[attr-defined]
    WebDriverWait(driver, web_inspector.WAIT_S).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, '#samples[data-loaded="0,0,0"]'))
    )
    shown = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "dd[data-column=uid]")]  # type: ignore[attr-defined]
    # A double would show all four as 4611686018427388000.
    assert shown == [str(BIG + i) for i in range(4)]
    stats = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#stats-body table.stats td")  # type: ignore[attr-defined]
    )
    summary = stats[3].text
    assert summary.startswith(f"{BIG} / ") and summary.endswith(str(BIG + routes.STATS_ROWS - 1))


def test_a_lookup_stopped_at_its_budget_says_how_far_it_searched(
    browser: object, server: str
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(f"{server}/ui")  # type: ignore[attr-defined]
    box = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_element(By.CSS_SELECTOR, '#where-form input[name="expr"]')  # type: ignore[attr-defined]
    )
    box.send_keys(f"uid == {BIG + ROWS - 1}\n")
    items = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#where-results li")  # type: ignore[attr-defined]
    )
    text = " ".join(i.text for i in items)
    assert "no sample matches" not in text
    assert f"first {routes.WHERE_SCAN_ROWS:,} of {ROWS:,} rows" in text
