"""/dashboard in chromium: the page loads behind the password, a subscriber appears
in the table, the numbers move as transactions flow, and the backup gate's state
(closed while no backup covers the replica, open once one does, closed again when
the backup wedges) shows as it changes. Each test saves a screenshot under its
tmp_path, and the run ends with a list of them ("dashboard screenshots")."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

from playwright.async_api import Browser, Page, expect

from app.client import ChangeStreamerClient, SubscriptionContext
from tests.dashboard.conftest import SCREENSHOTS
from tests.serve_pg.conftest import Serve, ServeFactory, Writer, create_workload_schema
from tests.serve_pg.test_backups import backup_env

ADMIN = "dash-admin-pw"
OPERATOR = "dash-operator-pw"
SECOND_S = 1000  # playwright's timeouts are in ms
# The demo's transactions: quick enough to see the numbers move every second.
DEMO_RATE = "20"


async def open_dashboard(
    browser: Browser, serve: Serve, password: str, *, width: int = 1280, height: int = 900
) -> Page:
    context = await browser.new_context(
        http_credentials={"username": "ops", "password": password},
        viewport={"width": width, "height": height},
    )
    page = await context.new_page()
    reply = await page.goto(f"http://127.0.0.1:{serve.port}/dashboard")
    assert reply is not None
    assert reply.status == 200
    await expect(page.locator("#connection")).to_have_text("live", timeout=10 * SECOND_S)
    return page


@contextlib.asynccontextmanager
async def following(serve: Serve, subscriber_id: str, task_id: str) -> AsyncIterator[None]:
    """A serving subscriber of ``serve`` that reads (and acks) everything until the
    block ends, then leaves."""
    client = ChangeStreamerClient(f"ws://127.0.0.1:{serve.port}")
    replica_version = await client.probe_replica_version()
    context = SubscriptionContext(subscriber_id, replica_version, replica_version, task_id=task_id)
    subscription = await client.subscribe(context)

    async def follow() -> None:
        async for _ in subscription:  # each message is acked when the next is asked for
            pass

    follower = asyncio.create_task(follow(), name="dashboard test subscriber")
    try:
        yield
    finally:
        await subscription.close()
        follower.cancel()
        with contextlib.suppress(BaseException):
            await follower


async def screenshot(page: Page, path: Path) -> None:
    await page.screenshot(path=path, full_page=True)
    SCREENSHOTS.append(path)  # listed at the end of the test output


async def test_a_subscriber_appears_and_the_numbers_move_as_transactions_flow(
    serve_factory: ServeFactory, browser: Browser, tmp_path: Path
) -> None:
    serve = serve_factory(
        "",  # no upstream: the demo source
        ZERO_ADMIN_PASSWORD=ADMIN,
        ZERO_OPERATOR_PASSWORD=OPERATOR,
        CHANGESTREAMER_DEMO_TRANSACTIONS_PER_SECOND=DEMO_RATE,
    )
    serve.start()
    await serve.wait_ready()
    page = await open_dashboard(browser, serve, OPERATOR)
    await expect(page.locator("#ready")).to_have_text("ready")
    await expect(page.locator("#upstream-type")).to_have_text("demo")
    await expect(page.locator("#backup-gate")).to_have_text("open")
    await expect(page.locator("#subscribers tbody")).to_have_text("no subscribers")

    async with following(serve, "browser-sub-1", "view-syncer-9"):
        row = page.locator('#subscribers tr[data-subscriber="browser-sub-1"]')
        await expect(row).to_be_visible(timeout=10 * SECOND_S)
        await expect(row.locator("td.task")).to_have_text("view-syncer-9")
        await expect(row.locator("td.mode")).to_have_text("serving")
        await expect(row.locator("td.protocol")).to_have_text("v6")
        await expect(row.locator("td.catch-up")).to_have_text("live", timeout=10 * SECOND_S)

        # The numbers move: the stream's transaction count, the subscriber's acked
        # watermark, the change log's newest watermark.
        for locator in (
            page.locator("#stream-transactions"),
            row.locator("td.acked"),
            page.locator("#changelog-max"),
        ):
            before = await locator.text_content()
            await expect(locator).not_to_have_text(before or "", timeout=10 * SECOND_S)
        await expect(page.locator("#stream-transactions")).to_have_text(re.compile(r"/s\)$"))
        await expect(page.locator("#changelog-rows")).not_to_have_text("—")
        # The charts are drawn.
        for chart in ("throughput", "lag", "backlog"):
            await expect(page.locator(f"#chart-{chart} canvas")).to_have_count(1)
        await screenshot(page, tmp_path / "dashboard-demo.png")

    # The subscriber went: its row goes too.
    await expect(page.locator('#subscribers tr[data-subscriber="browser-sub-1"]')).to_have_count(
        0, timeout=10 * SECOND_S
    )
    await page.context.close()
    await serve.terminate()


async def test_on_a_phone_the_page_fits_its_width(
    serve_factory: ServeFactory, browser: Browser, tmp_path: Path
) -> None:
    serve = serve_factory(
        "", ZERO_ADMIN_PASSWORD=ADMIN, CHANGESTREAMER_DEMO_TRANSACTIONS_PER_SECOND=DEMO_RATE
    )
    serve.start()
    await serve.wait_ready()
    async with following(serve, "a-subscriber-with-a-long-id-0123456789", "t"):
        page = await open_dashboard(browser, serve, ADMIN, width=390, height=844)
        row = page.locator(
            '#subscribers tr[data-subscriber="a-subscriber-with-a-long-id-0123456789"]'
        )
        await expect(row.locator("td.catch-up")).to_have_text("live", timeout=10 * SECOND_S)
        # The page itself never scrolls sideways; a wide table scrolls in its own box.
        widths = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in a {widths[1]} px screen"
        for section in ("#subscribers", "#chart-throughput"):
            box = await page.locator(section).bounding_box()
            assert box is not None, section
            assert box["x"] >= 0, section
        await screenshot(page, tmp_path / "dashboard-phone.png")
        await page.context.close()
    await serve.terminate()


async def test_the_backup_gate_shows_closed_open_and_closed_again(
    upstream: str, serve_factory: ServeFactory, browser: Browser, tmp_path: Path
) -> None:
    # A destination whose parent is a file: nothing can be backed up until it goes
    # (tests/serve_pg/test_backups.py does the same to /ready).
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    await create_workload_schema(upstream)
    serve = serve_factory(
        upstream,
        **backup_env(
            f"file://{blocker}/backup",
            ZERO_ADMIN_PASSWORD=ADMIN,
            CHANGESTREAMER_BACKUP_WEDGED_AFTER_SECONDS="2",
            ZERO_LITESTREAM_VFS_PROBE_TIMEOUT_MS="3000",
        ),
    )
    serve.start()
    await serve.wait_output(r"waiting for a backup that covers the replica at")
    page = await open_dashboard(browser, serve, ADMIN)
    gate = page.locator("#backup-gate")
    reason = page.locator("#backup-reason")

    # 1. Closed: no backup covers the replica yet; /ready is gated on it.
    await expect(gate).to_have_text("closed", timeout=30 * SECOND_S)
    await expect(reason).to_contain_text("waiting for a backup that covers the replica")
    await expect(page.locator("#ready")).to_contain_text("not ready: gated: waiting for a backup")
    # This node's own destination under the backup URL (app/backup/destinations.py).
    destination = re.compile(
        rf"^file://{re.escape(str(blocker))}/backup/\d{{13}}-rm-1-[0-9a-f]{{6}}$"
    )
    await expect(page.locator("#backup-url")).to_have_text(destination)
    await expect(page.locator("#backup-litestream")).to_contain_text("running (pid")
    await expect(page.locator("#upstream-type")).to_have_text("pg")
    slot = page.locator("#upstream-slots .slot")
    await expect(slot).to_have_count(1, timeout=30 * SECOND_S)
    await expect(slot).to_contain_text(re.compile(r"^hpf_0_\w+: [0-9.]+ (B|KiB|MiB|GiB)"))
    await screenshot(page, tmp_path / "dashboard-gate-waiting.png")

    # 2. Open: the destination becomes writable and the first backup covers the replica.
    blocker.unlink()
    await expect(gate).to_have_text("open", timeout=60 * SECOND_S)
    await expect(page.locator("#ready")).to_have_text("ready", timeout=10 * SECOND_S)
    await expect(page.locator("#backup-watermark")).not_to_have_text("—")

    # 3. Closed again: the destination breaks while the replica moves on, so the
    #    backup is wedged (after 2 s here) and /ready says so.
    writer = Writer(upstream, big_at=10_000)
    writer.start()
    try:
        away = tmp_path / "blocked-away"
        blocker.rename(away)
        blocker.write_text("in the way")
        await expect(gate).to_have_text("closed", timeout=60 * SECOND_S)
        await expect(reason).to_contain_text("backup wedged: no progress for")
        await expect(page.locator("#ready")).to_contain_text("not ready: owner: backup wedged")
        await screenshot(page, tmp_path / "dashboard-gate-wedged.png")
    finally:
        await writer.finish()
    await page.context.close()
    await serve.terminate()
