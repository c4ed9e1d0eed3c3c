"""The web inspector's lineage view in a real headless chromium: `shardcache web
--checkpoint-uri` over a run whose ranks skipped batches; following a sample leads to
the step that read it, and that step is what the rank was handed. Also over a run
resized to more ranks at another batch size (elastic resume): a link to a read of the
later world size opens that world size and batch size, not the first's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

import shardcache
from tests.support import inspect_data, web_inspector

pytestmark = [pytest.mark.integration, pytest.mark.browser]

WORLD, SEED, BATCH, BLOCK = 2, 3, 6, 16
#: The resized run: world size 2 at batch size 6, then 3 (a rank number the first
#: world size lacks) at batch size 4.
NEW_WORLD, NEW_BATCH = 3, 4


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
    yield from serving(run, ["--batch-size", str(BATCH)], tmp_path_factory.mktemp("log"))


def serving(run: tuple[str, Path, Path, object], extra: list[str], logs: Path) -> Iterator[str]:
    """`shardcache web` over `run`'s dataset and checkpoints, with `extra` arguments."""
    uri, cache, store, _ = run
    args = [uri, "--cache-dir", str(cache), "--checkpoint-uri", store.as_uri(), *extra]
    with web_inspector.serving(args, logs / "stderr.log") as url:
        yield url


def read_links(driver: Any, server: str, uid: int) -> list[Any]:
    """The lineage view's links to the reads of sample `uid`, once it lists them."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{server}/ui")
    section = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_element(By.ID, "lineage")
    )
    WebDriverWait(driver, web_inspector.WAIT_S).until(lambda d: section.is_displayed())
    box = driver.find_element(By.CSS_SELECTOR, '#lineage-form input[name="expr"]')
    box.send_keys(f"uid == {uid}\n")
    links: list[Any] = WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, '#lineage-results a[data-status="read"]')
    )
    return links


def test_lineage_view_leads_to_the_step_the_rank_was_handed_after_a_skip(
    browser: object, server: str, run: tuple[str, Path, Path, dict[int, list[list[int]]]]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    handed = run[3]
    # A sample rank 1 read after its skip: step 4 of its epoch, inside checkpoint 5.
    uid = handed[1][4][2]
    driver = browser
    link = read_links(driver, server, uid)[0]
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


@pytest.fixture(scope="module")
def resized(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, Path, Path, dict[int, list[list[int]]]]:
    """The dataset, its cache, the checkpoint store and what each rank of the later
    world size was handed: 2 ranks read 3 batches of 6 and publish checkpoint 3; 3
    ranks resume from those states (elastic), read 4 batches of 4 and publish
    checkpoint 7."""
    return record_resized(
        tmp_path_factory.mktemp("web-lineage-resized"), first_records_batch_size=True
    )


def record_resized(
    base: Path, *, first_records_batch_size: bool
) -> tuple[str, Path, Path, dict[int, list[list[int]]]]:
    """The resized run under `base`; without `first_records_batch_size` the first world size's
    checkpoints record no batch size, as a state does that was saved before its rank
    read a batch, or by a release before states recorded one (state version 1)."""
    uri = inspect_data.write(base / "ds").as_uri()
    cache, store = base / "cache", base / "store"

    def open_rank(rank: int, world_size: int) -> shardcache.Dataset:
        return shardcache.open(
            uri, cache_dir=cache, seed=SEED, rank=rank, world_size=world_size, block_size=BLOCK
        )

    old = []
    for rank in range(WORLD):
        with open_rank(rank, WORLD) as ds:
            batches = ds.batches(BATCH)
            for _ in range(3):
                next(batches)
            state = ds.state_dict()
            old.append(state if first_records_batch_size else {**state, "batch_size": None})
            web_inspector.publish(store, rank, 3, old[-1])
            batches.close()
    handed: dict[int, list[list[int]]] = {}
    for rank in range(NEW_WORLD):
        with open_rank(rank, NEW_WORLD) as ds:
            ds.load_state_dict(old)
            new_batches = ds.batches(NEW_BATCH)
            handed[rank] = [next(new_batches).column("uid").to_pylist() for _ in range(4)]
            web_inspector.publish(store, rank, 7, ds.state_dict())
            new_batches.close()
    return uri, cache, store, handed


@pytest.fixture(scope="module")
def resized_server(
    resized: tuple[str, Path, Path, object], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    # No --batch-size: the link alone says the read's.
    extra = ["--seed", str(SEED), "--block-size", str(BLOCK)]
    yield from serving(resized, extra, tmp_path_factory.mktemp("log"))


def test_lineage_link_to_a_later_generations_read_opens_its_world_and_batch_size(
    browser: object,
    resized_server: str,
    resized: tuple[str, Path, Path, dict[int, list[list[int]]]],
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    handed = resized[3]
    # Read by rank 2 of world size 3 (no such rank at world size 2) at its step 3.
    uid = handed[2][3][1]
    driver = browser
    [link] = read_links(driver, resized_server, uid)
    assert "rank 2 of 3, step 3" in link.text and "in checkpoints 7" in link.text
    # Whatever the step view answers (rows, or an error for a rank the view lacks).
    samples = driver.find_element(By.ID, "samples")  # type: ignore[attr-defined]
    driver.execute_script("arguments[0].dataset.loaded = ''", samples)  # type: ignore[attr-defined]
    link.click()
    WebDriverWait(driver, web_inspector.WAIT_S).until(
        lambda d: samples.get_attribute("data-loaded")
    )
    form = {
        name: driver.find_element(By.CSS_SELECTOR, f'#controls [name="{name}"]').get_attribute(
            "value"
        )  # type: ignore[attr-defined]
        for name in ("world_size", "batch_size", "rank", "step")
    }
    assert form == {"world_size": "3", "batch_size": "4", "rank": "2", "step": "3"}
    assert samples.get_attribute("data-loaded") == "0,2,3"
    shown = [
        int(a.get_attribute("data-index"))
        for a in driver.find_elements(By.CSS_SELECTOR, "article.sample")  # type: ignore[attr-defined]
    ]
    assert shown == handed[2][3], "the step is what rank 2 of world size 3 was handed"
    # The run line names every generation's world size and batch size.
    run_line = driver.find_element(By.ID, "lineage-run").text  # type: ignore[attr-defined]
    assert "world size 2 → 3, batch size 6 → 4" in run_line


@pytest.fixture(scope="module")
def unrecorded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    resized = record_resized(
        tmp_path_factory.mktemp("web-lineage-unrecorded"), first_records_batch_size=False
    )
    extra = ["--seed", str(SEED), "--block-size", str(BLOCK)]
    yield from serving(resized, extra, tmp_path_factory.mktemp("log"))


def test_lineage_run_line_says_not_recorded_for_a_generation_without_a_batch_size(
    browser: object, unrecorded_server: str
) -> None:
    from selenium.webdriver.common.by import By

    data = web_inspector.get_json(
        unrecorded_server, "/ui/api/lineage?limit=1000&expr=uid%20%3E%3D%200"
    )
    assert [g["batch_size"] for g in data["run"]["generations"]] == [None, NEW_BATCH]
    # A read of the later world size: its step is counted in batches of 4, so it links.
    uid = next(
        r["index"] for r in data["reads"] if r["status"] == "read" and r["world_size"] == NEW_WORLD
    )
    driver = browser
    read_links(driver, unrecorded_server, uid)
    run_line = driver.find_element(By.ID, "lineage-run").text  # type: ignore[attr-defined]
    assert "world size 2 → 3, batch size not recorded → 4" in run_line
