"""The Dagster UI tells the story: headless Debian Chromium (Playwright) over a real webserver and instance.

Setup: ``tests/browser/install.sh`` (apt-get chromium chromium-driver, pip playwright); the test skips
with that hint when either is missing. Screenshots go to ``$EAGLE3_TEST_ARTIFACTS`` (default
``<repo>/test-artifacts``): the asset graph, a synthetic_responses partition's metadata, its histogram.
"""

from __future__ import annotations

import contextlib
import os
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core.storage import DataLayout
from fake_vllm import FakeConfig, FakeServerProcess
from support.common import REPO_ROOT
from support.operations import (
    dagster_process,
    initialize_storage,
    make_dagster_home,
    materialize_partitions,
    wait_for,
    write_prompts,
    write_workspace,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
INSTALL_HINT = "run tests/browser/install.sh (apt-get install -y chromium chromium-driver; pip install playwright)"


def artifacts_dir() -> Path:
    path = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS") or REPO_ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def responds(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def webserver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """dagster-webserver over a DAGSTER_HOME holding raw_prompts and two synthetic_responses partitions."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: {INSTALL_HINT}")
    pytest.importorskip("playwright.sync_api", reason=f"playwright is not installed: {INSTALL_HINT}")
    home = make_dagster_home(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_prompts(tmp_path, 40)
    port = free_port()
    env = {"DAGSTER_HOME": str(home), "EAGLE3_DATA_DIR": str(layout.root), "EAGLE3_PROMPTS_PATH": str(dataset)}
    with dg.DagsterInstance.get() as instance:
        initialize_storage(instance)  # before the webserver opens the same SQLite files
        args = ["dagster-webserver", "-w", str(write_workspace(tmp_path)), "-h", "127.0.0.1", "-p", str(port)]
        log = tmp_path / "webserver.log"
        with dagster_process(args, env, tmp_path, log) as proc:
            # The webserver loads the code location while the partitions are generated.
            with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=200)) as server:
                materialize_partitions(instance, layout, dataset, 20, server.base_url, ok=["00000", "00001"], failed=[])
            url = f"http://127.0.0.1:{port}"

            def up() -> bool:
                assert proc.poll() is None, log.read_text()[-3000:]
                return responds(f"{url}/server_info")

            wait_for(up, 120, "dagster-webserver")
            try:
                yield url
            finally:
                (artifacts_dir() / "webserver.log").write_bytes(log.read_bytes())


LOCATION = "eagle3_assets"  # the workspace's location_name


def test_asset_graph_and_partition_metadata_render(webserver: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    out = artifacts_dir()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1600, "height": 1000})
        # The UI opens a newsletter dialog over the page on a first visit from 127.0.0.1 unless this
        # localStorage key says it was dismissed (dagster-webserver 1.13's "communityNux").
        context.add_init_script("window.localStorage.setItem('communityNux', JSON.stringify('1'))")
        page = context.new_page()
        page.set_default_timeout(60_000)
        try:
            # 1. The asset graph: every stage's group is shown; a group's own lineage page shows its assets
            # with kinds (the global graph collapses groups once there are several).
            page.goto(f"{webserver}/asset-groups", wait_until="networkidle")
            graph = page.locator("body")
            for group in ("prompts", "generation", "hidden_states", "draft", "evaluation"):
                expect(graph.get_by_text(group, exact=True).first).to_be_visible()
            page.screenshot(path=str(out / "asset_graph_groups.png"))
            page.goto(f"{webserver}/locations/{LOCATION}/asset-groups/generation/lineage", wait_until="networkidle")
            # the group's page renders its graph after the network settles (slowly on a busy machine); on a
            # timeout (playwright's TimeoutError) the global graph is expanded instead
            with contextlib.suppress(Exception):
                page.get_by_text("synthetic_responses", exact=True).first.wait_for(timeout=30_000)
            if not page.get_by_text("synthetic_responses", exact=True).count():
                page.goto(f"{webserver}/asset-groups", wait_until="networkidle")
                for group, asset in (("prompts", "raw_prompts"), ("generation", "synthetic_responses")):
                    expand_group(page, group, asset)
            expect(graph.get_by_text("synthetic_responses", exact=True).first).to_be_visible()
            expect(graph.get_by_text("vllm", exact=True).first).to_be_visible()  # a kind tag
            page.screenshot(path=str(out / "asset_graph.png"))

            # 2. The catalog's asset page: Dagster's own row count (dagster/row_count) and the column schema.
            page.goto(f"{webserver}/assets/raw_prompts", wait_until="networkidle")
            label = page.get_by_text("Row count", exact=True)
            expect(label).to_be_visible()
            expect(label.locator("xpath=..")).to_contain_text("40")
            expect(page.get_by_text("Columns", exact=True).first).to_be_visible()
            expect(page.get_by_text("sample_id", exact=True).first).to_be_visible()
            page.screenshot(path=str(out / "raw_prompts_row_count.png"), full_page=True)

            # 3. A partition page: dagster/partition_row_count and the token stats.
            page.goto(
                f"{webserver}/assets/synthetic_responses?view=partitions&partition=00000", wait_until="networkidle"
            )
            row = page.locator("tr", has=page.get_by_text("dagster/partition_row_count", exact=True))
            expect(row).to_contain_text("20")
            for key in ("ok", "completion_tokens", "output_tokens_per_s", "latency_p95_s"):
                expect(page.get_by_text(key, exact=True).first).to_be_visible()
            page.screenshot(path=str(out / "synthetic_responses_partition.png"), full_page=True)

            # 4. The length histogram: a real PNG decoded by the browser (not a broken image).
            page.locator("tr", has=page.get_by_text("completion_length_histogram", exact=True)).get_by_text(
                "[Show Markdown]"
            ).click()
            image = page.locator("img[src^='data:image/png'][alt='Completion length, partition 00000']")
            expect(image).to_be_visible()
            assert image.evaluate("img => img.complete && img.naturalWidth > 100 && img.naturalHeight > 100")
            page.screenshot(path=str(out / "synthetic_responses_histogram.png"))
        except Exception:
            page.screenshot(path=str(out / "browser_failure.png"), full_page=True)
            raise
        finally:
            browser.close()
    for name in ("asset_graph.png", "synthetic_responses_partition.png", "synthetic_responses_histogram.png"):
        assert (out / name).stat().st_size > 10_000, name


def expand_group(page, group: str, asset: str) -> None:  # type: ignore[no-untyped-def]
    """Expand a collapsed group node of the lineage graph until ``asset`` shows.

    The global lineage shows several groups collapsed; the toggle is an icon without a label at the right end
    of the node's title row, so it is clicked by position, once the graph has rendered and stopped moving.
    """
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if page.get_by_text(asset, exact=True).count():
            return
        # Group titles also appear in the sidebar tree (left of the graph): take the one in the graph.
        titles = [e for e in page.get_by_text(group, exact=True).all() if (e.bounding_box() or {}).get("x", 0) > 560]
        if titles:
            page.wait_for_timeout(500)  # let the fit-to-screen zoom settle
            title = titles[0].bounding_box()
            node = titles[0].locator("xpath=ancestor::div[3]").bounding_box()
            if title and node:
                page.mouse.click(node["x"] + node["width"] - 16, title["y"] + title["height"] / 2)
        page.wait_for_timeout(1000)
    raise AssertionError(f"group {group!r} of the asset graph did not expand to show {asset!r}")
