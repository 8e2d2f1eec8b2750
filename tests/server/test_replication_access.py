"""Who may open a replication websocket (issue 25), on a real server on loopback.

Browsers apply no same-origin policy to websockets: an upgrade with an ``Origin``
that is not allowed is refused before accept (403), while view-syncers (no Origin)
get in. The optional replication password is Basic auth (401 when missing or
wrong). Idle ``/v7/subscribe`` sockets are closed; ``/subscribe`` and ``/snapshot``
sockets count toward the subscriber limit; the protocol version comes from the
request line, never from the ``Host`` header.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from app.cli import build_parser
from app.client.client import ChangeStreamerClient
from app.client.credentials import (
    REPLICATION_PASSWORD_ENV,
    PasswordFileError,
    replication_password,
)
from app.client.errors import UnauthorizedError
from app.client.resume import ReconnectPolicy, ResumingSubscription
from app.client.subscription import Subscription, SubscriptionContext
from app.client.tail import run_tail
from app.commands.replicate import run_replicate
from app.protocol.canonical_json import dumps, loads
from app.runtime.held_reservation import HeldReservation
from app.server.admin_auth import LoginBackoff
from app.server.log_lines import limit_lines
from app.server.replication_access import ReplicationAccess
from tests.replica.conftest import new_replica
from tests.waiting import eventually

from .conftest import Server, free_port, start_server

BACKUP_URL = "file:///backups/replica"
CHANGES = "/replication/v6/changes?id=a&replicaVersion=01&watermark=01"
SNAPSHOT = "/replication/v6/snapshot?taskID=t1"
SUBSCRIBE = "/replication/v7/subscribe"
ENDPOINTS = [CHANGES, SNAPSHOT, SUBSCRIBE]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    async for s in start_server(
        tmp_path, backup_url=BACKUP_URL, allowed_origins=("https://Admin.Example:8443",)
    ):
        yield s


async def status_of(url: str, headers: dict[str, str] | None = None) -> int:
    """The HTTP status the upgrade got (101 if it was accepted)."""
    try:
        async with connect(url, additional_headers=headers, open_timeout=10):
            return 101
    except InvalidStatus as e:
        return e.response.status_code


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_a_browser_origin_is_refused_before_accept(server: Server, path: str) -> None:
    assert await status_of(server.url + path, {"Origin": "https://evil.example"}) == 403
    assert await status_of(server.url + path, {"Origin": "null"}) == 403  # a sandboxed page
    assert server.service.reservations.open_tasks == []  # nothing was reserved


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_no_origin_and_an_allowed_origin_are_accepted(server: Server, path: str) -> None:
    assert await status_of(server.url + path) == 101
    # Origins compare case-insensitively, a trailing slash aside.
    assert await status_of(server.url + path, {"Origin": "https://admin.example:8443/"}) == 101


async def test_refusals_are_logged_at_info_and_bounded(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    limit_lines()  # as serve installs it
    for _ in range(20):
        assert await status_of(server.url + CHANGES, {"Origin": "https://evil.example"}) == 403
    # The refusals are this one line: uvicorn logs neither an access line for each
    # one nor "ASGI callable returned without completing handshake" at ERROR.
    lines = [r for r in caplog.records if r.name.startswith(("app.server", "uvicorn"))]
    assert len(lines) == 1, [(r.name, r.getMessage()) for r in lines]
    assert lines[0].name == "app.server.replication_access"
    assert lines[0].levelno == logging.INFO
    assert "'https://evil.example' is not allowed" in lines[0].getMessage()


async def test_later_refusals_are_one_summary_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "app.server.replication_access")
    access = ReplicationAccess(password="pw", log_interval_s=0.0)
    scope = {"client": ("127.0.0.1", 5), "headers": [(b"origin", b"https://evil.example")]}
    for _ in range(3):
        assert await access.check(scope) is not None
    assert await access.check({"client": ("127.0.0.1", 6), "headers": []}) is not None
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        "refused a replication upgrade from 127.0.0.1:5: 403 "
        "(origin 'https://evil.example' is not allowed)"
    )
    assert lines[1].startswith("refused 1 × 403 more replication upgrades in 0 s")
    assert lines[2].startswith("refused 1 × 403 more replication upgrades in 0 s")
    assert lines[3].startswith("refused a replication upgrade from 127.0.0.1:6: 401")
    assert len(lines) == 4


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[Server]:
    async for s in start_server(tmp_path, backup_url=BACKUP_URL, replication_password="s3cr-t"):
        yield s


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_the_replication_password_is_required(guarded: Server, path: str) -> None:
    url = guarded.url + path
    assert await status_of(url) == 401
    assert await status_of(url, basic("zero", "wrong")) == 401
    assert await status_of(url, {"Authorization": "Bearer s3cr-t"}) == 401
    assert await status_of(url, basic("zero", "s3cr-t")) == 101
    # As Node's ws sends it from ZERO_CHANGE_STREAMER_URI's user info: any user name,
    # the password as written in the URL (percent-escapes not decoded).
    assert await status_of(url, basic("", "s3cr%2Dt")) == 101
    # User info in the URL (websockets sends it as Basic auth, as ws does).
    userinfo = guarded.url.replace("ws://", "ws://zero:s3cr-t@")
    assert await status_of(userinfo + path) == 101


async def test_wrong_replication_passwords_are_backed_off_unchecked(
    guarded: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the admin passwords are (LoginBackoff, at its defaults): after the free
    failures, an address's upgrades are held until its wait is over or refused
    with 429 at once, their passwords not compared; parallel upgrades buy no more
    guesses, and the right password gets in once the wait is over."""
    checked: list[bytes] = []
    compare = ReplicationAccess.authorized

    def counting(self: ReplicationAccess, header: bytes) -> bool:
        checked.append(header)
        return compare(self, header)

    monkeypatch.setattr(ReplicationAccess, "authorized", counting)
    url = guarded.url + CHANGES
    free = LoginBackoff.FREE_FAILURES
    first = [await status_of(url, basic("zero", f"guess-{i}")) for i in range(free + 1)]
    # 20 at once: within the server's handshake burst (start_server: 50 a second).
    flood = await asyncio.gather(
        *(status_of(url, basic("zero", f"parallel-guess-{i}")) for i in range(20))
    )
    flood_checks = len(checked) - (free + 1)
    right = await status_of(url, basic("zero", "s3cr-t"))
    assert first == [401] * (free + 1)
    assert set(flood) <= {401, 429}
    assert flood.count(401) == flood_checks  # 401: compared; 429: not
    assert flood_checks <= LoginBackoff.MAX_HELD_PER_ADDRESS  # one a wait (1 s, 2 s, …)
    assert right == 101
    assert guarded.service.reservations.open_tasks == []


async def test_a_browser_origin_is_refused_even_with_the_password(guarded: Server) -> None:
    headers = {**basic("zero", "s3cr-t"), "Origin": "https://evil.example"}
    assert await status_of(guarded.url + CHANGES, headers) == 403


@pytest.mark.parametrize("version", [6, 7])
async def test_our_client_sends_the_password(guarded: Server, version: int) -> None:
    ctx = SubscriptionContext("me", "01", "01")
    client = ChangeStreamerClient(guarded.url, protocol_version=version, password="s3cr-t")
    async with await client.subscribe(ctx) as subscription:
        assert subscription is not None
    # And one without it is refused, with a one-line error.
    with pytest.raises(Exception, match="401"):
        await ChangeStreamerClient(guarded.url, protocol_version=version).subscribe(ctx)
    assert "s3cr-t" not in repr(client.base)
    assert "s3cr-t" not in str(client.base)


@pytest.mark.parametrize("version", [6, 7])
@pytest.mark.parametrize("password", [None, "wrong-pw"])
async def test_a_refused_password_is_one_final_line_without_the_password(
    guarded: Server, version: int, password: str | None
) -> None:
    client = ChangeStreamerClient(guarded.url, protocol_version=version, password=password)
    for opening in (client.subscribe(SubscriptionContext("me", "01", "01")),
                    client.reserve_snapshot("t1")):  # fmt: skip
        with pytest.raises(UnauthorizedError) as refused:
            await opening
        message = str(refused.value)
        assert refused.value.status == 401
        assert message.startswith(f"{guarded.url}/replication/v{version}/")  # no user info
        assert message.endswith(
            "HTTP 401: the replication password is missing or wrong; "
            "set CHANGESTREAMER_REPLICATION_PASSWORD or pass --password-file"
        )
        assert "\n" not in message
        assert "wrong-pw" not in message
        assert "@" not in message
    assert guarded.service.reservations.open_tasks == []


@pytest.mark.parametrize("password", [None, "wrong-pw"])
async def test_a_resuming_subscription_raises_a_refused_password_at_once(
    guarded: Server, password: str | None
) -> None:
    client = ChangeStreamerClient(guarded.url, password=password)
    attempts: list[SubscriptionContext] = []

    async def counted(ctx: SubscriptionContext) -> Subscription:
        attempts.append(ctx)
        return await client.subscribe(ctx)

    # A retry would wait a minute first, far past the bound below.
    policy = ReconnectPolicy(initial_delay_s=60.0, max_attempts=3)
    subscription = ResumingSubscription(counted, SubscriptionContext("me", "01", "01"), policy)
    with pytest.raises(UnauthorizedError, match="HTTP 401"):
        await asyncio.wait_for(subscription.__anext__(), 5)
    # Final: the subscription is closed, asking again connects no more.
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(subscription.__anext__(), 5)
    assert len(attempts) == 1
    assert subscription.connections == 0


async def test_an_idle_v7_subscribe_socket_is_closed_by_its_deadline(tmp_path: Path) -> None:
    async for server in start_server(tmp_path, first_message_timeout_s=0.3):
        async with connect(server.url + SUBSCRIBE) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 1002
        assert "no reserve-snapshot or start-subscription within 0.3 s" in closed.value.rcvd.reason


async def test_a_v7_socket_that_sent_its_first_message_outlives_the_deadline(
    tmp_path: Path,
) -> None:
    async for server in start_server(tmp_path, backup_url=BACKUP_URL, first_message_timeout_s=0.3):
        async with connect(server.url + SUBSCRIBE) as ws:
            await ws.send(dumps({"id": 1, "msg": ["reserve-snapshot", {"taskID": "t1"}]}))
            assert loads(await asyncio.wait_for(ws.recv(), 10)) == {"ack": 1}
            # Well past the deadline, the socket is still open (it waits for a backup).
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ws.recv(), 1.0)
            assert server.service.reservations.is_open("t1")


async def closed_with(url: str) -> tuple[int, str]:
    """The close code and reason of a socket the server closes at once."""
    async with connect(url, open_timeout=10) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, closed.value.rcvd.reason


@pytest.mark.parametrize("holder", [SUBSCRIBE, SNAPSHOT])
async def test_subscribe_and_snapshot_sockets_count_toward_the_subscriber_limit(
    tmp_path: Path, holder: str
) -> None:
    async for server in start_server(tmp_path, backup_url=BACKUP_URL, max_subscribers=1):
        async with connect(server.url + holder, open_timeout=10):
            # The one place is this socket's: a subscriber, a second holder, refused.
            for path in (CHANGES, holder):
                code, reason = await closed_with(server.url + path)
                assert code == 1002
                assert "serves at most 1 subscribers" in reason
        # The holder left: its place is free again (once the server saw it go).
        await eventually(
            functools.partial(subscribed, server.url + CHANGES), "a subscriber in the freed place"
        )


async def subscribed(url: str) -> bool:
    """Whether a subscription at ``url`` gets its first message (not a refusal)."""
    async with connect(url, open_timeout=10) as ws:
        try:
            return bool(loads(await asyncio.wait_for(ws.recv(), 10)))
        except ConnectionClosed:
            return False


async def test_the_version_comes_from_the_request_line_not_the_host_header(
    server: Server,
) -> None:
    """Starlette builds ``websocket.url`` from the Host header; a Host that holds a
    path must not change the version parsed from the request line."""
    host = "evil/replication/v7/subscribe?"
    code, reason = await closed_with_host(server.url + "/replication/v99/changes?id=a", host)
    assert code == 1002
    assert "Cannot service client at protocol v99" in reason


async def closed_with_host(url: str, host: str) -> tuple[int, str]:
    async with connect(url, open_timeout=10, additional_headers={"Host": host}) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, closed.value.rcvd.reason


# -- our own clients with the replication password (tail, replicate, a takeover) ----


def tail_args(url: str, *extra: str) -> argparse.Namespace:
    args = build_parser().parse_args(["tail", url, *extra])
    args.limit = 0  # return once subscribed (the command line takes N >= 1)
    return args


async def test_tail_sends_the_password_from_the_environment_or_a_file(
    guarded: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    err = io.StringIO()
    code = await asyncio.to_thread(run_tail, tail_args(guarded.url), io.StringIO(), err)
    assert code == 2
    assert "401" in err.getvalue()
    assert err.getvalue().count("\n") == 1
    secret = tmp_path / "password"
    secret.write_text("s3cr-t\n")
    assert (
        await asyncio.to_thread(
            run_tail, tail_args(guarded.url, "--password-file", str(secret)), io.StringIO(), err
        )
        == 0
    )
    monkeypatch.setenv(REPLICATION_PASSWORD_ENV, "s3cr-t")
    assert await asyncio.to_thread(run_tail, tail_args(guarded.url), io.StringIO(), err) == 0
    missing = io.StringIO()
    args = tail_args(guarded.url, "--password-file", str(tmp_path / "missing"))
    assert run_tail(args, io.StringIO(), missing) == 2
    assert missing.getvalue().startswith("changestreamer tail: cannot read --password-file")


@pytest.mark.parametrize("password", [None, "wrong-pw"])
async def test_tail_stops_on_a_refused_password_with_one_line_and_status_2(
    guarded: Server, tmp_path: Path, password: str | None
) -> None:
    extra: tuple[str, ...] = ()
    if password is not None:
        (tmp_path / "password").write_text(f"{password}\n")
        extra = ("--password-file", str(tmp_path / "password"))
    # Reconnecting would go on for a minute: a retry does not end within the bound.
    # --replica-version: no probe, the first connection is the resuming subscription's.
    args = tail_args(guarded.url, "--replica-version", "01", "--give-up-after", "60", *extra)
    args.limit = 1
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.wait_for(asyncio.to_thread(run_tail, args, out, err), 10)
    assert (code, out.getvalue()) == (2, "")
    assert err.getvalue() == (
        f"changestreamer tail: {guarded.url}/replication/v6/changes answered HTTP 401: "
        "the replication password is missing or wrong; "
        "set CHANGESTREAMER_REPLICATION_PASSWORD or pass --password-file\n"
    )
    assert "wrong-pw" not in err.getvalue()


@contextlib.contextmanager
def guarded_on_a_thread(tmp_path: Path) -> Iterator[str]:
    """The ``guarded`` server on a loop of its own thread; its URL. For a command that
    runs its own loop on the main thread (replicate: signal handlers need that)."""
    urls: list[str] = []
    stops: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    ready = threading.Event()

    async def serve() -> None:
        try:
            stop = asyncio.Event()
            async for server in start_server(
                tmp_path, backup_url=BACKUP_URL, replication_password="s3cr-t"
            ):
                stops.append((asyncio.get_running_loop(), stop))
                urls.append(server.url)
                ready.set()
                await stop.wait()
        finally:
            ready.set()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="guarded server")
    thread.start()
    try:
        assert ready.wait(30)
        assert urls, "the guarded server did not start"
        yield urls[0]
    finally:
        for loop, stop in stops:
            loop.call_soon_threadsafe(stop.set)
        thread.join(30)


@pytest.mark.parametrize("password", [None, "wrong-pw"])
@pytest.mark.parametrize("replica_exists", [True, False], ids=["subscribing", "restoring"])
def test_replicate_stops_on_a_refused_password_with_one_line_and_status_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    restore_logging: None,
    replica_exists: bool,
    password: str | None,
) -> None:
    replica = tmp_path / "r.db"
    if replica_exists:
        new_replica(replica)
    extra: tuple[str, ...] = ()
    if password is not None:
        (tmp_path / "password").write_text(f"{password}\n")
        extra = ("--password-file", str(tmp_path / "password"))
    with guarded_on_a_thread(tmp_path) as url:
        args = build_parser().parse_args(
            ["replicate", url, "--replica", str(replica), "--log-level", "warn", *extra]
        )  # (this process's log also has the server's INFO line about the refusal)
        # A retry loop would not end by itself: Ctrl-C it after a while (exit status 130).
        interrupt = threading.Timer(30, os.kill, (os.getpid(), signal.SIGINT))
        interrupt.start()
        try:
            code = run_replicate(args)
        finally:
            interrupt.cancel()
    out, err = capsys.readouterr()
    endpoint = "changes" if replica_exists else "snapshot"
    line = (
        f"changestreamer replicate: {url}/replication/v6/{endpoint} answered HTTP 401: "
        "the replication password is missing or wrong; "
        "set CHANGESTREAMER_REPLICATION_PASSWORD or pass --password-file"
    )
    assert (code, out, err) == (2, "", line + "\n")
    assert "wrong-pw" not in err


def test_replicate_reads_its_password_file_or_stops_in_one_line(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["replicate", "ws://127.0.0.1:9", "--replica", str(tmp_path / "r.db"),
         "--password-file", str(tmp_path / "missing")]
    )  # fmt: skip
    assert args.password_file == tmp_path / "missing"
    with pytest.raises(PasswordFileError, match="cannot read --password-file"):
        replication_password(args.password_file, {})
    secret = tmp_path / "password"
    secret.write_text("s3cr-t\n")
    assert replication_password(secret, {}) == "s3cr-t"
    assert replication_password(None, {REPLICATION_PASSWORD_ENV: "from-env"}) == "from-env"


async def test_a_takeover_reserves_on_a_guarded_owner_with_the_shared_password(
    guarded: Server,
) -> None:
    address = guarded.url.removeprefix("ws://")
    refused = HeldReservation(address, "takeover-1")
    assert not await asyncio.to_thread(refused.start)  # 401: no reservation
    assert "takeover-1" not in guarded.service.reservations.open_tasks
    held = HeldReservation(address, "takeover-2", password="s3cr-t")
    # (This owner has no backup to report, so start() would wait out its timeout for
    # the reservation's status; the reservation itself is what the password opens.)
    starting = asyncio.ensure_future(asyncio.to_thread(held.start))
    try:
        await eventually(
            lambda: "takeover-2" in guarded.service.reservations.open_tasks,
            "the reservation is open on the owner",
        )
    finally:
        await asyncio.to_thread(held.release)
        starting.cancel()


@pytest.mark.parametrize("password", [None, "wrong-pw"])
async def test_a_takeover_refused_by_a_guarded_owner_warns_that_the_password_must_be_shared(
    guarded: Server, caplog: pytest.LogCaptureFixture, password: str | None
) -> None:
    caplog.set_level(logging.INFO, "app.runtime.held_reservation")
    address = guarded.url.removeprefix("ws://")
    refused = HeldReservation(address, "takeover-1", password=password)
    assert not await asyncio.to_thread(refused.start)
    assert "takeover-1" not in guarded.service.reservations.open_tasks
    records = [r for r in caplog.records if r.name == "app.runtime.held_reservation"]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (
            logging.WARNING,
            f"no snapshot reservation on the current owner {address}: it refused this "
            "node's replication password (HTTP 401); the nodes must share one "
            "CHANGESTREAMER_REPLICATION_PASSWORD",
        )
    ]


async def test_a_takeover_from_an_owner_that_is_gone_is_only_noted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "app.runtime.held_reservation")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert not await asyncio.to_thread(HeldReservation(address, "takeover-1").start)
    records = [r for r in caplog.records if r.name == "app.runtime.held_reservation"]
    assert [r.levelno for r in records] == [logging.INFO]
    assert (
        records[0]
        .getMessage()
        .startswith(f"no snapshot reservation on the current owner {address}: cannot connect to ")
    )
