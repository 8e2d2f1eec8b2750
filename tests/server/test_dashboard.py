"""/dashboard over real loopback HTTP: the password rules (those of /statz), what a
snapshot holds for a streaming service, the event stream and its bounds, the page's
files. The page in a real browser: tests/dashboard/."""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi import FastAPI
from websockets.asyncio.client import connect

from app.protocol.canonical_json import loads
from app.server.admin_auth import AdminAuth
from app.server.dashboard import STATIC_FILES, dashboard_router
from app.server.dashboard_feed import SnapshotFeed
from tests.waiting import eventually

from .conftest import REPLICA_VERSION, Server, start_server
from .http import Reply, http_get, serve
from .test_replication_ws import txn

ADMIN = "s3cret-admin"
OPERATOR = "op-password"
PRODUCTION = AdminAuth(ADMIN, OPERATOR, development=False)
CHALLENGE = 'Basic realm="Dashboard Protected Area"'
TIMEOUT_S = 10.0


def basic(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"admin:{password}".encode()).decode()}


async def get(url: str, password: str | None = None) -> Reply:
    return await http_get(url, basic(password) if password is not None else None)


# -- the password rules ------------------------------------------------------------


@pytest.fixture
async def protected(tmp_path: Path) -> AsyncIterator[Server]:
    async for server in start_server(tmp_path, auth=PRODUCTION):
        yield server


PAGES = ["/dashboard", "/dashboard/snapshot", "/dashboard/static/dashboard.js"]


async def test_no_password_or_a_wrong_one_is_401_with_the_dashboard_realm(
    protected: Server,
) -> None:
    base = protected.url.replace("ws://", "http://")
    for path in [*PAGES, "/dashboard/events"]:
        missing = await get(base + path)
        wrong = await get(base + path, "not-it")
        longer = await get(base + path, ADMIN + "x")
        for reply in (missing, wrong, longer):
            assert (reply.status, reply.text) == (401, "Unauthorized"), path
            assert reply.headers["WWW-Authenticate"] == CHALLENGE


async def test_the_admin_and_the_operator_password_open_it(protected: Server) -> None:
    base = protected.url.replace("ws://", "http://")
    for password in (ADMIN, OPERATOR):
        for path in PAGES:
            reply = await get(base + path, password)
            assert reply.status == 200, (path, reply.text)
        async with events(base + "/dashboard/events", password) as stream:
            assert "ready" in await stream.next()


async def test_development_mode_without_an_admin_password_opens_it(tmp_path: Path) -> None:
    open_auth = AdminAuth(None, None, development=True)
    async for server in start_server(tmp_path, auth=open_auth):
        reply = await get(server.url.replace("ws://", "http://") + "/dashboard/snapshot")
        assert reply.status == 200


# -- what a snapshot holds -------------------------------------------------------------


async def test_a_snapshot_shows_a_subscriber_the_stream_the_log_and_the_backup_gate(
    protected: Server,
) -> None:
    base = protected.url.replace("ws://", "http://")
    query = f"replicaVersion={REPLICA_VERSION}&watermark={REPLICA_VERSION}"
    changes = f"{protected.url}/replication/v6/changes?{query}"
    async with (
        connect(f"{changes}&id=vs-1&taskID=task-7") as ws,
        connect(f"{changes}&id=vs-2") as idle,
    ):
        await idle.send(f'{{"ack":{loads(await idle.recv())["id"]}}}')  # its status, then no more
        stream = await asyncio.wait_for(protected.source.wait_for_stream(), TIMEOUT_S)
        stream.push_all([*txn("02", 3), *txn("03", 2)])
        acked = 0
        while acked < 10:  # the status, then two transactions (5 + 4 messages)
            frame = loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
            await ws.send(f'{{"ack":{frame["id"]}}}')
            acked += 1
        await asyncio.wait_for(protected.service.storer.wait_durable("03"), TIMEOUT_S)
        await eventually(
            lambda: sorted(protected.service.forwarder.acks()) == ["01", "03"],
            "the first subscriber's ack of 03",
        )
        reply = await get(base + "/dashboard/snapshot", OPERATOR)

    assert reply.status == 200
    assert reply.headers["Cache-Control"] == "no-store"
    snapshot = reply.json()
    assert list(snapshot) == [
        "time",
        "running",
        "ready",
        "errors",
        "stream",
        "subscribers",
        "upstream",
        "changeLog",
        "backup",
        "reservations",
    ]
    assert snapshot["running"] is True
    assert snapshot["ready"] == {"ok": True, "reason": None}
    assert snapshot["errors"] == {}

    stream_values = snapshot["stream"]
    assert stream_values["transactions"] == 2
    assert stream_values["changes"] == 5
    assert stream_values["durableWatermark"] == "03"
    assert stream_values["replicaVersion"] == REPLICA_VERSION
    assert set(stream_values["flowControl"]["waits"]) == {"all-subscribers", "consensus-timeout"}
    for key in ("storerQueuedBytes", "backlogBytes", "pendingMessages", "eventLoopLagMs"):
        assert key in stream_values

    sub, idle_sub = sorted(snapshot["subscribers"], key=lambda s: str(s["id"]))
    assert sub["id"] == "vs-1"
    assert sub["taskID"] == "task-7"
    assert (sub["mode"], sub["state"], sub["protocolVersion"]) == ("serving", "active", 6)
    assert (sub["watermark"], sub["acked"]) == ("03", "03")
    assert sub["lagTransactions"] == 0
    assert sub["lagMs"] == 0
    assert sub["missedReleases"] == 0
    assert sub["lagging"] is False
    assert sub["catchingUp"] is False
    assert sub["catchUp"] == {"from": REPLICA_VERSION, "to": REPLICA_VERSION, "progress": 1.0}
    for key in ("bufferedBytes", "pendingMessages", "backlogMessages"):
        assert isinstance(sub[key], int)
    # The one that stopped acking: both commits are durable and not acked by it.
    assert (idle_sub["id"], idle_sub["taskID"]) == ("vs-2", None)
    assert (idle_sub["watermark"], idle_sub["acked"]) == ("03", "01")
    assert idle_sub["lagTransactions"] == 2
    assert idle_sub["lagMs"] >= 0
    assert idle_sub["pendingMessages"] == 9

    upstream = snapshot["upstream"]
    assert upstream["type"] == "memory"
    assert upstream["lastCommit"] == "03"
    assert upstream["lastCommitAgeSeconds"] >= 0
    assert upstream["lagSeconds"] is None  # this source sends no lag reports
    assert upstream["lagReport"] is None
    assert upstream["slots"] == []  # a Postgres source's only

    change_log = snapshot["changeLog"]
    assert change_log["rows"] == 2 + 9  # the replica version's rows, then both transactions
    assert change_log["bytes"] > 0
    assert (change_log["minWatermark"], change_log["maxWatermark"]) == ("01", "03")
    assert set(change_log["purge"]) >= {"floor", "heldBy", "purgedBelow", "rowsDeleted"}

    backup = snapshot["backup"]
    assert backup["url"] is None
    assert backup["gate"] == {"open": True, "reason": None}
    assert backup["covered"] is True
    assert backup["problem"] is None
    assert backup["litestream"] is None
    assert snapshot["reservations"] == {"open": [], "longestSeconds": 0.0}


async def test_without_a_service_the_snapshot_says_so() -> None:
    router, _feed = dashboard_router(
        PRODUCTION, lambda: None, lambda: (False, "the change streamer is not running")
    )
    app = FastAPI()
    app.include_router(router)
    async with serve(app) as url:
        snapshot = (await get(url + "/dashboard/snapshot", ADMIN)).json()
    assert snapshot["running"] is False
    assert snapshot["ready"] == {"ok": False, "reason": "the change streamer is not running"}
    assert snapshot["subscribers"] == []
    assert snapshot["backup"]["gate"]["open"] is False
    assert set(snapshot["errors"]) == {"replication", "backup"}


# -- the event stream --------------------------------------------------------------------


@dataclass
class Events:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    status: int
    headers: dict[str, str]

    async def next(self) -> str:
        """The next event's data; '' at the end. Each event is one chunk of the
        chunked body: the chunk-size lines and the ``retry`` field are skipped."""
        async with asyncio.timeout(TIMEOUT_S):
            data = ""
            while True:
                line = await self.reader.readline()
                if not line:
                    return ""
                text = line.decode().rstrip("\r\n")
                if text.startswith("data: "):
                    data += text[len("data: ") :]
                elif text == "" and data:
                    return data


class _EventsContext:
    def __init__(self, url: str, password: str) -> None:
        self._url = url
        self._password = password
        self._events: Events | None = None

    async def __aenter__(self) -> Events:
        host_port, _, path = self._url.removeprefix("http://").partition("/")
        host, _, port = host_port.partition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        auth = basic(self._password)["Authorization"]
        request = f"GET /{path} HTTP/1.1\r\nHost: {host_port}\r\nAuthorization: {auth}\r\n"
        writer.write(request.encode() + b"Connection: close\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), TIMEOUT_S)
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await asyncio.wait_for(reader.readline(), TIMEOUT_S)) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        self._events = Events(reader, writer, status, headers)
        return self._events

    async def __aexit__(self, *exc: object) -> None:
        assert self._events is not None
        self._events.writer.close()
        await self._events.writer.wait_closed()


def events(url: str, password: str) -> _EventsContext:
    """``/dashboard/events`` over a raw connection (closed when the block ends)."""
    return _EventsContext(url, password)


@dataclass
class Feed:
    url: str
    feed: SnapshotFeed
    computed: list[int]
    draining: asyncio.Event


@pytest.fixture
async def fast_feed() -> AsyncIterator[Feed]:
    """A dashboard whose snapshots come every 20 ms, at most two streams at once."""
    computed: list[int] = []

    def ready() -> tuple[bool, str]:
        computed.append(1)
        return True, ""

    def clock() -> float:  # each snapshot's "time": the number of its computation
        return len(computed) / 1000

    draining = asyncio.Event()
    router, feed = dashboard_router(
        PRODUCTION,
        lambda: None,
        ready,
        feed_interval_s=0.02,
        max_streams=2,
        draining=draining,
        wall_clock=clock,
    )
    app = FastAPI()
    app.include_router(router)
    async with serve(app) as url:
        yield Feed(url + "/dashboard/events", feed, computed, draining)
    await feed.aclose()


async def test_events_are_json_snapshots_as_server_sent_events(fast_feed: Feed) -> None:
    async with events(fast_feed.url, ADMIN) as stream:
        assert stream.status == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.headers["cache-control"] == "no-store"
        first = loads(await stream.next())
        second = loads(await stream.next())
    assert isinstance(first, dict)
    assert isinstance(second, dict)
    assert second["time"] >= first["time"]
    assert first["running"] is False


async def test_at_most_max_streams_and_a_client_that_goes_frees_its_slot(
    fast_feed: Feed,
) -> None:
    async with events(fast_feed.url, ADMIN) as one, events(fast_feed.url, OPERATOR) as two:
        assert await one.next()
        assert await two.next()
        assert fast_feed.feed.streams == 2
        async with events(fast_feed.url, ADMIN) as third:
            assert third.status == 503
            assert third.headers["retry-after"] == "2"
    # Both clients went: their slots are free, and nothing is computed for nobody.
    await eventually(lambda: fast_feed.feed.streams == 0, "the streams' slots back")
    assert not fast_feed.feed.computing
    async with events(fast_feed.url, ADMIN) as again:
        assert again.status == 200
        assert await again.next()
        assert fast_feed.feed.computing


async def test_streams_share_one_computation_per_interval(fast_feed: Feed) -> None:
    async with events(fast_feed.url, ADMIN) as one, events(fast_feed.url, OPERATOR) as two:
        seen_one = [loads(await one.next())["time"] for _ in range(5)]
        seen_two = [loads(await two.next())["time"] for _ in range(5)]
    # Each computation has a time of its own (the fixture's clock counts them): the
    # two streams were sent the same snapshots.
    assert set(seen_one) & set(seen_two)
    assert seen_one == sorted(seen_one)


async def test_streams_end_when_the_server_drains(fast_feed: Feed) -> None:
    async with events(fast_feed.url, ADMIN) as stream:
        assert await stream.next()
        fast_feed.draining.set()
        async with asyncio.timeout(TIMEOUT_S):
            while await stream.next():  # what was on its way still arrives; then the end
                pass
    await eventually(lambda: fast_feed.feed.streams == 0, "the stream's slot back")


async def test_a_server_shutting_down_ends_the_streams_at_once(protected: Server) -> None:
    # uvicorn waits for responses in progress (here without a bound): the event
    # streams must end by themselves when it starts shutting down.
    base = protected.url.replace("ws://", "http://")
    async with events(base + "/dashboard/events", ADMIN) as stream:
        assert await stream.next()
        protected.http.should_exit = True
        async with asyncio.timeout(TIMEOUT_S):
            while await stream.next():
                pass


# -- the page and its files --------------------------------------------------------------


async def test_the_page_loads_only_its_own_files(protected: Server) -> None:
    base = protected.url.replace("ws://", "http://")
    page = await get(base + "/dashboard", ADMIN)
    assert page.status == 200
    assert page.headers.get_content_type() == "text/html"
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    references = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert references
    assert all(ref.startswith("dashboard/static/") for ref in references), references
    for ref in references:
        reply = await get(f"{base}/{ref}", ADMIN)
        name = ref.removeprefix("dashboard/static/")
        assert reply.status == 200, ref
        assert reply.headers["Content-Type"] == STATIC_FILES[name]
    assert "http://" not in page.text
    assert "https://" not in page.text
    js = await get(base + "/dashboard/static/dashboard.js", ADMIN)
    assert "innerHTML" not in js.text  # values go in as text: ids come from clients
    license_text = await get(base + "/dashboard/static/uPlot.LICENSE", ADMIN)
    assert "MIT License" in license_text.text


async def test_only_the_listed_files_are_served(protected: Server) -> None:
    base = protected.url.replace("ws://", "http://")
    for name in ("admin.py", "..%2Fadmin.py", "dashboard.html", "nope.js"):
        reply = await get(f"{base}/dashboard/static/{name}", ADMIN)
        assert reply.status == 404, name


async def test_a_stream_ends_after_its_lifetime_and_gives_its_slot_back() -> None:
    """A client cannot hold the few stream slots forever: each stream ends after
    its lifetime (the page's EventSource reconnects, through the password check)."""
    router, feed = dashboard_router(
        PRODUCTION, lambda: None, lambda: (True, ""), feed_interval_s=0.02, stream_lifetime_s=0.5
    )
    app = FastAPI()
    app.include_router(router)
    try:
        async with serve(app) as url, events(url + "/dashboard/events", ADMIN) as stream:
            assert await stream.next()
            received = 1
            async with asyncio.timeout(TIMEOUT_S):
                while await stream.next():  # snapshots until the stream ends by itself
                    received += 1
            assert received > 1
            await eventually(lambda: feed.streams == 0, "the stream's slot back")
    finally:
        await feed.aclose()
