"""Admin endpoints over real loopback HTTP: the password check (wire.md §4.2),
/statz groups and formats (§4.1), and /profile."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import marshal
import pstats
import re
import tracemalloc
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from app import speedups
from app.commands.serve import proxy_header_options
from app.protocol import canonical_json, wsframes
from app.server.admin import admin_router, profile_seconds
from app.server.admin_auth import STARTUP_ERROR, AdminAuth, LoginBackoff, Role, check_startup
from app.server.heap import HeapTracer
from app.server.profiler import LoopProfiler
from app.server.statz import render_text, replica_file_stats, service_stats
from app.sources.postgres import copy_load
from app.sources.postgres import mapper as pg_mapper
from app.streamer import rowrun, subscriber
from app.streamer.service import ChangeStreamerService, SubscriberContext
from tests.waiting import eventually

from .conftest import REPLICA_VERSION, new_service
from .http import Reply, http_get, serve

ADMIN = "s3cret-admin"
OPERATOR = "op-password"

STATZ_CHALLENGE = 'Basic realm="Statz Protected Area"'
PROFILE_CHALLENGE = 'Basic realm="Profile Protected Area"'

Stats = Callable[[frozenset[str] | None], Awaitable[dict[str, dict[str, Any]]]]

# -- a real server on loopback -------------------------------------------------


async def get(url: str, password: str | None = None, user: str = "admin") -> Reply:
    headers = {}
    if password is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    return await http_get(url, headers)


def basic(password: str, user: str = "") -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# -- a change-streamer service over a SQLite log (not running) ---------------------


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[ChangeStreamerService]:
    db, _source, svc = await new_service(tmp_path, task_id="admin-test")
    try:
        yield svc
    finally:
        svc.forwarder.close_all()
        await svc.storer.catchups.close()
        await db.dispose()


def admin_app(
    auth: AdminAuth,
    stats: Stats | None = None,
    profiler: LoopProfiler | None = None,
    heap: HeapTracer | None = None,
) -> FastAPI:
    async def os_only(groups: frozenset[str] | None) -> dict[str, dict[str, Any]]:
        return await service_stats(None, groups)

    app = FastAPI()
    app.include_router(admin_router(auth, stats or os_only, profiler=profiler, heap=heap))
    return app


async def second_while_first_runs(
    app: FastAPI,
    path: str,
    busy: Callable[[], bool],
    password: str,
    *,
    second_path: str | None = None,
) -> tuple[Reply, Reply]:
    """Starts ``path`` (a one-at-a-time capture), asks for ``second_path`` (default
    the same) once ``busy()``; the second reply and the first one's."""
    async with serve(app) as url:
        first = asyncio.create_task(get(url + path, ADMIN))
        await eventually(lambda: busy() or first.done(), "the first capture to start")
        assert busy()
        second = await get(url + (second_path or path), password)
        done = await first
    return second, done


PRODUCTION = AdminAuth(ADMIN, OPERATOR, development=False)


# -- the password check (wire.md §4.2) ------------------------------------------


async def test_no_credentials_is_401_with_the_realm_of_each_endpoint() -> None:
    async with serve(admin_app(PRODUCTION)) as url:
        statz = await get(url + "/statz")
        profile = await get(url + "/profile?seconds=1")
    assert (statz.status, statz.text) == (401, "Unauthorized")
    assert statz.headers["WWW-Authenticate"] == STATZ_CHALLENGE
    assert (profile.status, profile.text) == (401, "Unauthorized")
    assert profile.headers["WWW-Authenticate"] == PROFILE_CHALLENGE


async def test_a_wrong_password_is_401() -> None:
    async with serve(admin_app(PRODUCTION)) as url:
        wrong = await get(url + "/statz", "not-it")
        prefix = await get(url + "/statz", ADMIN[:-1])
        longer = await get(url + "/statz", ADMIN + "x")
    for reply in (wrong, prefix, longer):
        assert reply.status == 401
        assert reply.headers["WWW-Authenticate"] == STATZ_CHALLENGE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


LOOPBACK = "127.0.0.1"
FREE = LoginBackoff.FREE_FAILURES
# The passwords a guess at /statz may find (the operator's and the admin's).
STATZ_SECRETS = ("admin", "operator")


def refusing(clock: Clock) -> LoginBackoff:
    """A back-off on a clock that moves only when told, holding no request: once an
    address must wait, each of its passwords is answered 429 at once, unchecked."""
    backoff = LoginBackoff(clock)
    backoff.MAX_HELD_PER_ADDRESS = 0
    return backoff


async def get_alone(
    url: str, path: str, password: str, forwarded_for: str | None = None
) -> tuple[int, dict[str, str]]:
    """GET with a password on a connection of its own, so that any number are in
    flight at once (``get`` runs on the few threads of the default executor); the
    status and the headers (names in lower case)."""
    host, port = urllib.parse.urlsplit(url).netloc.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    forwarded = f"X-Forwarded-For: {forwarded_for}\r\n" if forwarded_for else ""
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {basic(password)}\r\n"
            f"{forwarded}Connection: close\r\n\r\n".encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 90)
    finally:
        writer.close()
    status_line, *lines = head.decode("latin-1").split("\r\n")
    fields = (line.split(":", 1) for line in lines if line)
    return int(status_line.split()[1]), {name.lower(): value.strip() for name, value in fields}


def count_checks(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The Authorization values whose password ``AdminAuth`` compared, as it compares them."""
    checked: list[str | None] = []
    compare = AdminAuth.granted

    def counting(self: AdminAuth, authorization: str | None, role: Role) -> Role | None:
        if authorization is not None:
            checked.append(authorization)
        return compare(self, authorization, role)

    monkeypatch.setattr(AdminAuth, "granted", counting)
    return checked


async def test_once_an_address_must_wait_its_passwords_are_429_unchecked_until_it_has() -> None:
    clock = Clock()
    backoff = refusing(clock)
    auth = AdminAuth(ADMIN, None, development=False, backoff=backoff)
    async with serve(admin_app(auth)) as url:
        first = [(await get(url + "/statz", f"guess-{i}")).status for i in range(FREE + 1)]
        blocked = await get(url + "/statz", "another-guess")
        # Not compared either: a guesser learns nothing before the wait is over.
        right_during_the_wait = await get(url + "/statz", ADMIN)
        clock.now += 1.0
        # No lockout: once the wait is over, the right password gets in and clears
        # the count (ten more guesses are free again).
        right_after_the_wait = await get(url + "/statz", ADMIN)
        again = [(await get(url + "/statz", f"guess-{i}")).status for i in range(FREE)]
    assert first == [401] * (FREE + 1)
    assert (blocked.status, blocked.headers["Retry-After"]) == (429, "1")
    assert (right_during_the_wait.status, right_during_the_wait.headers["Retry-After"]) == (
        429,
        "1",
    )
    assert right_after_the_wait.status == 200
    assert again == [401] * FREE
    assert backoff.wrong_total == 2 * FREE + 1  # the wrong passwords compared


async def test_a_parallel_guesser_gets_its_passwords_checked_once_per_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """80 wrong passwords at once from an address that must wait: a few are held
    until the wait is over, the rest answered 429 at once, and none is compared
    before the wait is over; the right password, sent after them, gets in once the
    wait it meets is over (the defaults: 10 free failures, waits of 1 s, 2 s, …)."""
    checked = count_checks(monkeypatch)
    backoff = LoginBackoff()
    auth = AdminAuth(ADMIN, OPERATOR, development=False, backoff=backoff)
    async with serve(admin_app(auth)) as url:
        first = [(await get(url + "/statz", f"guess-{i}")).status for i in range(FREE + 1)]
        assert len(checked) == FREE + 1
        flood = await asyncio.gather(
            *(get_alone(url, "/statz", f"parallel-guess-{i}") for i in range(80))
        )
        flood_checks = len(checked) - (FREE + 1)
        right = await get_alone(url, "/statz", ADMIN)
    assert first == [401] * (FREE + 1)
    statuses = [status for status, _ in flood]
    assert set(statuses) <= {401, 429}
    # 401: compared (and wrong); 429: not compared. One password a wait is compared:
    # whichever comes first once a wait is over (1 s, then 2 s, 4 s, 8 s: this is
    # at most four waits' worth, however slow the machine).
    assert statuses.count(401) == flood_checks
    assert flood_checks <= LoginBackoff.MAX_HELD_PER_ADDRESS
    assert all(int(headers["retry-after"]) >= 1 for status, headers in flood if status == 429)
    assert right[0] == 200
    assert len(checked) == FREE + 1 + flood_checks + 1


async def test_held_passwords_are_bounded_per_address_and_in_all() -> None:
    """Held passwords wait for the end of their address's wait, then are compared;
    past the per-address bound or the global one, they are refused at once."""
    backoff = LoginBackoff()
    backoff.MAX_HELD_PER_ADDRESS = 1
    backoff.MAX_HELD = 2
    auth = AdminAuth(ADMIN, OPERATOR, development=False, backoff=backoff)
    addresses = ["192.0.2.1", "192.0.2.2", "192.0.2.3"]
    for address in addresses:
        for _ in range(FREE + 4):  # an 8 s wait: time to see requests held, however slow
            backoff.failed(address, STATZ_SECRETS)
    async with serve(admin_app(auth), **proxy_header_options([LOOPBACK])) as url:

        def held(password: str, address: str) -> asyncio.Task[tuple[int, dict[str, str]]]:
            return asyncio.create_task(get_alone(url, "/statz", password, address))

        right = held(ADMIN, addresses[0])
        await eventually(lambda: backoff.held == 1, "the first address's password held")
        same_address = await get_alone(url, "/statz", "a-guess", addresses[0])
        wrong = held("a-guess", addresses[1])
        await eventually(lambda: backoff.held == 2, "the second address's password held")
        beyond_all = await get_alone(url, "/statz", "a-guess", addresses[2])
        assert same_address[0] == 429
        assert beyond_all[0] == 429
        # Held until the wait was over, then compared.
        assert (await right)[0] == 200
        assert (await wrong)[0] == 401
    assert backoff.held == 0


async def test_an_operator_login_does_not_clear_the_admin_failures() -> None:
    """Guesses at the admin password (/profz opens with it only) are not forgiven
    by the operator's password: knowing it must not buy guesses at the admin's."""
    clock = Clock()
    auth = AdminAuth(ADMIN, OPERATOR, development=False, backoff=refusing(clock))
    async with serve(admin_app(auth)) as url:
        guesses = [(await get(url + "/profz", f"guess-{i}")).status for i in range(FREE)]
        operator = await get(url + "/statz", OPERATOR)
        after = [(await get(url + "/profz", f"more-{i}")).status for i in range(2)]
        clock.now += 1.0
        admin = await get(url + "/profz?seconds=1", ADMIN)
    assert guesses == [401] * FREE
    assert operator.status == 200
    assert after == [401, 429]  # the eleventh in a row, then the wait
    assert admin.status == 200


async def test_an_admin_login_does_not_clear_the_operator_failures() -> None:
    """And the other way round: each password's guesses are its own."""
    clock = Clock()
    auth = AdminAuth(ADMIN, OPERATOR, development=False, backoff=refusing(clock))
    async with serve(admin_app(auth)) as url:
        guesses = [(await get(url + "/statz", f"guess-{i}")).status for i in range(FREE)]
        admin = await get(url + "/profz?seconds=1", ADMIN)
        after = [(await get(url + "/statz", f"more-{i}")).status for i in range(2)]
        clock.now += 1.0
        operator = await get(url + "/statz", OPERATOR)
    assert guesses == [401] * FREE
    assert admin.status == 200
    assert after == [401, 429]
    assert operator.status == 200


async def test_the_back_off_keys_on_the_peer_not_on_x_forwarded_for() -> None:
    """serve's uvicorn options believe no X-Forwarded-For by default: a client that
    rotates the header still meets the back-off, and cannot lock out an address it
    names; with the proxy trusted, the header is the client."""

    async def guesses(options: dict[str, Any]) -> tuple[list[int], LoginBackoff]:
        backoff = refusing(Clock())
        auth = AdminAuth(ADMIN, OPERATOR, development=False, backoff=backoff)
        statuses = []
        async with serve(admin_app(auth), **options) as url:
            for i in range(FREE + 2):
                headers = {
                    "Authorization": basic(f"guess-{i}"),
                    "X-Forwarded-For": f"203.0.113.{i}",
                }
                statuses.append((await http_get(url + "/statz", headers)).status)
        return statuses, backoff

    statuses, backoff = await guesses(proxy_header_options([]))
    assert statuses == [401] * (FREE + 1) + [429]
    assert backoff.wait_s(LOOPBACK, STATZ_SECRETS) > 0
    assert backoff.wait_s("203.0.113.0", STATZ_SECRETS) == 0  # a named address is not locked out
    trusted, _ = await guesses(proxy_header_options([LOOPBACK]))
    assert trusted == [401] * (FREE + 2)  # each guess from its own (forwarded) client


def test_the_wait_doubles_to_a_cap_and_memory_is_bounded() -> None:
    clock = Clock()
    backoff = LoginBackoff(clock)
    waits = []
    for _ in range(FREE + 8):
        backoff.failed("10.0.0.1", ("admin",))
        waits.append(backoff.wait_s("10.0.0.1", ("admin",)))
    assert waits[:FREE] == [0.0] * FREE
    assert waits[FREE:] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert backoff.wait_s("10.0.0.1", ("operator",)) == 0.0  # another password's count
    clock.now += LoginBackoff.FORGET_S
    assert backoff.wait_s("10.0.0.1", ("admin",)) == 0.0  # forgotten after a quiet while
    for i in range(LoginBackoff.MAX_ADDRESSES + 100):
        backoff.failed(f"addr-{i}", ("admin",))
    assert len(backoff._failures) == LoginBackoff.MAX_ADDRESSES
    assert ("addr-0", "admin") not in backoff._failures  # the least recent went first


async def test_the_admin_password_opens_statz_whatever_the_username() -> None:
    async with serve(admin_app(PRODUCTION)) as url:
        named = await get(url + "/statz", ADMIN, user="someone")
        anonymous = await get(url + "/statz", ADMIN, user="")
    assert named.status == 200
    assert anonymous.status == 200
    assert "=== os ===" in named.text


async def test_the_operator_password_opens_statz_but_not_the_costly_pages() -> None:
    async with serve(admin_app(PRODUCTION)) as url:
        statz = await get(url + "/statz", OPERATOR)
        costly = [
            await get(url + path, OPERATOR)
            for path in ("/profile?seconds=1", "/profz?seconds=1", "/heapz", "/heapz?seconds=1")
        ]
        profile = await get(url + "/profile?seconds=1", ADMIN)
    assert statz.status == 200
    assert [reply.status for reply in costly] == [401] * 4
    assert profile.status == 200
    assert profile.headers.get_content_type() == "application/octet-stream"


async def test_development_mode_without_a_password_is_open_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    auth = AdminAuth(None, None, development=True)
    caplog.set_level(logging.WARNING, logger="app.server.admin")
    async with serve(admin_app(auth)) as url:
        first = await get(url + "/statz")
        second = await get(url + "/statz?format=json")
    assert first.status == 200
    assert second.status == 200
    warnings = [r for r in caplog.records if "admin endpoints are open" in r.getMessage()]
    assert len(warnings) == 1


async def test_open_pages_answer_only_their_own_host_names() -> None:
    # A DNS-rebinding page (its name resolving to 127.0.0.1) sends its own name as the
    # Host; the open pages would give it /statz, /profz and /heapz.
    auth = AdminAuth(None, None, development=True, allowed_hosts=["Node-1.Internal"])
    async with serve(admin_app(auth)) as url:
        port = url.rsplit(":", 1)[1]
        answers = {
            host: (await http_get(url + "/statz", {"Host": host})).status
            for host in (
                f"evil.example:{port}",
                "evil.example",
                f"localhost:{port}",
                f"127.0.0.1:{port}",
                f"[::1]:{port}",
                "[::1]",
                f"node-1.internal:{port}",
                f"127.0.0.1.evil.example:{port}",
            )
        }
        profile = await http_get(url + "/profile?seconds=1", {"Host": "evil.example"})
    assert answers == {
        f"evil.example:{port}": 403,
        "evil.example": 403,
        f"localhost:{port}": 200,
        f"127.0.0.1:{port}": 200,
        f"[::1]:{port}": 200,
        "[::1]": 200,
        f"node-1.internal:{port}": 200,
        f"127.0.0.1.evil.example:{port}": 403,
    }
    assert profile.status == 403
    # With a password the Host is not the guard (a rebinding page has no password).
    async with serve(admin_app(PRODUCTION)) as url:
        evil = await http_get(
            url + "/statz", {"Host": "evil.example", "Authorization": basic(ADMIN)}
        )
    assert evil.status == 200


async def test_without_an_admin_password_outside_development_everything_is_denied() -> None:
    auth = AdminAuth(None, OPERATOR, development=False)
    async with serve(admin_app(auth)) as url:
        bare = await get(url + "/statz")
        operator = await get(url + "/statz", OPERATOR)
        empty = await get(url + "/statz", "")
    assert [bare.status, operator.status, empty.status] == [401, 401, 401]
    assert check_startup(None, development=False) == STARTUP_ERROR
    assert check_startup("", development=False) == STARTUP_ERROR
    assert STARTUP_ERROR == (
        "ZERO_ADMIN_PASSWORD is required outside development mode (NODE_ENV=development)"
    )


def test_startup_is_allowed_with_a_password_or_in_development() -> None:
    assert check_startup(ADMIN, development=False) is None
    assert check_startup(None, development=True) is None
    assert check_startup(ADMIN, development=True) is None


@pytest.mark.parametrize(
    ("auth", "header", "role", "allowed"),
    [
        # Development relaxes only the case of no password at all.
        (AdminAuth(None, None, True), None, Role.ADMIN, True),
        (AdminAuth(None, None, True), basic("guess"), Role.OPERATOR, False),
        (AdminAuth(None, None, True), basic(""), Role.ADMIN, True),  # empty is none (zero)
        (AdminAuth(ADMIN, None, True), None, Role.OPERATOR, False),
        (AdminAuth(ADMIN, None, True), basic(ADMIN), Role.OPERATOR, True),
        # The operator password opens read-only endpoints only.
        (PRODUCTION, basic(OPERATOR), Role.OPERATOR, True),
        (PRODUCTION, basic(OPERATOR), Role.ADMIN, False),
        (PRODUCTION, basic(ADMIN), Role.ADMIN, True),
        (AdminAuth(ADMIN, None, False), basic(""), Role.OPERATOR, False),
        # The username is ignored; the password may hold colons.
        (AdminAuth("a:b", None, False), basic("a:b", user="x"), Role.ADMIN, True),
        # Malformed headers carry no password.
        (PRODUCTION, "Basic !!!not-base64", Role.OPERATOR, False),
        (PRODUCTION, "Basic " + base64.b64encode(ADMIN.encode()).decode(), Role.ADMIN, False),
        (PRODUCTION, f"Bearer {ADMIN}", Role.ADMIN, False),
        (AdminAuth(None, None, True), "Basic !!!", Role.ADMIN, True),
        # The scheme is case-insensitive.
        (PRODUCTION, basic(ADMIN).replace("Basic", "basic"), Role.ADMIN, True),
    ],
)
def test_password_rules(auth: AdminAuth, header: str | None, role: Role, allowed: bool) -> None:
    assert (auth.granted(header, role) is not None) is allowed


# -- /statz -------------------------------------------------------------------------


async def test_statz_text_has_a_section_per_group_with_key_value_lines(
    service: ChangeStreamerService,
) -> None:
    app = admin_app(PRODUCTION, lambda groups: service_stats(service, groups))
    async with serve(app) as url:
        reply = await get(url + "/statz", ADMIN)
    assert reply.status == 200
    assert reply.headers.get_content_type() == "text/plain"
    headings = re.findall(r"^=== (\w+) ===$", reply.text, re.MULTILINE)
    assert headings == [
        "upstream",
        "changeLog",
        "replica",
        "replication",
        "backup",
        "os",
        "speedups",
    ]
    change_log = reply.text.split("=== changeLog ===\n")[1].split("\n\n")[0]
    lines = change_log.splitlines()
    assert re.fullmatch(r"bytes: [1-9]\d*", lines.pop(3)), change_log  # pages in use
    assert lines == [
        "rows: 2",
        "minWatermark: 01",
        "maxWatermark: 01",
        'writerProcess: {"pid":null,"starts":0}',
    ]
    assert "\nlastWatermark: 01\n" in reply.text
    assert '\nsubscribers: {"active":0,"queued":0}\n' in reply.text


async def test_statz_json_holds_the_change_streamer_groups(
    service: ChangeStreamerService,
) -> None:
    service.subscribe(
        SubscriberContext(
            protocol_version=6,
            id="vs-1",
            mode="serving",
            replica_version=REPLICA_VERSION,
            watermark=REPLICA_VERSION,
        )
    )
    app = admin_app(PRODUCTION, lambda groups: service_stats(service, groups))
    async with serve(app) as url:
        reply = await get(url + "/statz?format=json", ADMIN)
    assert reply.status == 200
    assert reply.headers.get_content_type() == "application/json"
    assert b"\n" not in reply.body  # compact unless pretty
    stats = reply.json()
    assert list(stats) == [
        "upstream",
        "changeLog",
        "replica",
        "replication",
        "backup",
        "os",
        "speedups",
    ]
    assert stats["upstream"] == {"type": "memory"}  # the test's in-memory change source
    assert stats["replica"] == {"file": None}
    writer = stats["changeLog"].pop("writerProcess")
    assert stats["changeLog"].pop("bytes") > 0
    assert stats["changeLog"] == {"rows": 2, "minWatermark": "01", "maxWatermark": "01"}
    assert stats["backup"]["purge"]["heldBy"] is None  # no purge pass yet
    assert stats["backup"]["reservations"] == {"open": [], "longestSeconds": 0.0, "held": []}
    # The SQLite writer process starts with the storer; this service never streamed.
    assert writer == {"pid": None, "starts": 0}
    replication = stats["replication"]
    assert replication["lastWatermark"] == "01"
    assert replication["replicaVersion"] == REPLICA_VERSION
    assert replication["owner"] is None
    assert replication["taskID"] == "admin-test"
    assert replication["subscribers"] == {"active": 1, "queued": 0}
    assert [s["id"] for s in replication["subscriberDetails"]] == ["vs-1"]
    assert replication["subscriberDetails"][0]["state"] == "active"
    assert replication["storerQueuedBytes"] == 0
    assert replication["flowControl"] == {
        "waits": {"all-subscribers": 0, "consensus-timeout": 0},
        "waitSeconds": 0,
    }
    os_group = stats["os"]
    assert isinstance(os_group["pid"], int)
    assert os_group["pythonVersion"].startswith("3.")
    assert os_group["uptimeSeconds"] >= 0
    assert os_group["rssBytes"] > 0
    assert len(os_group["loadAverage"]) == 3


async def test_statz_says_which_speedups_run_as_json_and_text(
    service: ChangeStreamerService,
) -> None:
    app = admin_app(PRODUCTION, lambda groups: service_stats(service, groups))
    async with serve(app) as url:
        reply = await get(url + "/statz?format=json&group=speedups", ADMIN)
        text = await get(url + "/statz?group=speedups", ADMIN)
    group = reply.json()["speedups"]
    # What the modules really use: each site holds the C function or its Python twin.
    in_use = {
        "jsscan": canonical_json._scan is not canonical_json.scan_py,
        "wsfast": wsframes.ack_ids is not wsframes._ack_ids_py,
        "rowrun": rowrun.encode_rows is not rowrun.encode_rows_py,
        "fanout": subscriber.select_live is not subscriber._select_live_py,
        "pgrows": pg_mapper._pgrows is not None,
        "copyload": copy_load.active(),
    }
    assert group == {"summary": speedups.summary(), **in_use}
    if not speedups.ENABLED:
        assert group["summary"] == "pure Python (CHANGESTREAMER_SPEEDUPS=0)"
        assert not any(in_use.values())
    elif all(in_use.values()):
        assert group["summary"] == "C (jsscan, wsfast, rowrun, fanout, pgrows, copyload)"
    lines = text.text.splitlines()
    assert lines[:2] == ["=== speedups ===", f"summary: {group['summary']}"]
    assert lines[2:] == [f"{name}: {str(on).lower()}" for name, on in in_use.items()]


async def test_statz_group_filter_takes_comma_lists_and_repeats_and_ignores_unknowns(
    service: ChangeStreamerService,
) -> None:
    app = admin_app(PRODUCTION, lambda groups: service_stats(service, groups))
    async with serve(app) as url:
        comma = await get(url + "/statz?format=json&group=os,changeLog", ADMIN)
        repeated = await get(url + "/statz?format=json&group=os&group=changeLog", ADMIN)
        unknown = await get(url + "/statz?format=json&group=nope,os", ADMIN)
        text = await get(url + "/statz?group=replication", ADMIN)
    assert list(comma.json()) == ["changeLog", "os"]
    assert list(repeated.json()) == ["changeLog", "os"]
    assert list(unknown.json()) == ["os"]
    assert re.findall(r"^=== (\w+) ===$", text.text, re.MULTILINE) == ["replication"]


async def test_statz_pretty_indents_json_by_two_spaces() -> None:
    async def stats(_groups: frozenset[str] | None) -> dict[str, dict[str, Any]]:
        return {"g": {"a": 1, "b": [1, 2]}}

    async with serve(admin_app(PRODUCTION, stats)) as url:
        pretty = await get(url + "/statz?format=json&pretty", ADMIN)
        compact = await get(url + "/statz?format=json", ADMIN)
    assert pretty.text == json.dumps({"g": {"a": 1, "b": [1, 2]}}, indent=2)
    assert pretty.text.startswith('{\n  "g": {\n    "a": 1')
    assert compact.text == '{"g":{"a":1,"b":[1,2]}}'


async def test_a_failing_group_reports_its_error_and_the_rest_still_answers(
    service: ChangeStreamerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_count() -> int:
        raise RuntimeError("change DB unreachable")

    monkeypatch.setattr(service.change_log, "count", broken_count)
    app = admin_app(PRODUCTION, lambda groups: service_stats(service, groups))
    async with serve(app) as url:
        reply = await get(url + "/statz?format=json", ADMIN)
        text = await get(url + "/statz?group=changeLog", ADMIN)
    assert reply.status == 200
    stats = reply.json()
    assert stats["changeLog"] == {"error": "RuntimeError: change DB unreachable"}
    assert stats["replication"]["lastWatermark"] == "01"
    assert "pid" in stats["os"]
    assert text.text == "=== changeLog ===\nerror: RuntimeError: change DB unreachable\n"


async def test_without_a_service_the_streamer_groups_report_it_and_os_still_answers() -> None:
    stats = await service_stats(None)
    assert stats["changeLog"] == {"error": "RuntimeError: the change streamer is not running"}
    assert stats["replication"] == {"error": "RuntimeError: the change streamer is not running"}
    assert "pid" in stats["os"]


async def test_statz_answers_500_when_the_stats_source_itself_fails() -> None:
    async def stats(_groups: frozenset[str] | None) -> dict[str, dict[str, Any]]:
        raise RuntimeError("no stats")

    async with serve(admin_app(PRODUCTION, stats)) as url:
        reply = await get(url + "/statz", ADMIN)
    assert reply.status == 500
    assert reply.json() == {"error": "collecting stats failed: RuntimeError: no stats"}


def test_text_format_prints_strings_raw_and_everything_else_as_json() -> None:
    text = render_text({"a": {"s": "x y", "n": 3, "b": True, "z": None}, "b": {"l": [1, "2"]}})
    assert text == '=== a ===\ns: x y\nn: 3\nb: true\nz: null\n\n=== b ===\nl: [1,"2"]\n'


# -- /profile -----------------------------------------------------------------------


async def test_profile_returns_a_pstats_attachment_that_loads(tmp_path: Path) -> None:
    async with serve(admin_app(PRODUCTION)) as url:
        reply = await get(url + "/profile?seconds=1", ADMIN)
    assert reply.status == 200
    assert reply.headers.get_content_type() == "application/octet-stream"
    disposition = reply.headers["Content-Disposition"]
    match = re.fullmatch(
        r'attachment; filename="(changestreamer-\d{8}T\d{6}Z\.pstats)"', disposition
    )
    assert match is not None, disposition
    path = tmp_path / match.group(1)
    path.write_bytes(reply.body)
    stats = pstats.Stats(str(path))
    assert stats.total_calls > 0  # type: ignore[attr-defined]
    functions = {name for (_file, _line, name) in stats.stats}  # type: ignore[attr-defined]
    assert "sleep" in functions  # the profiled request itself awaited asyncio.sleep


async def test_profile_seconds_must_be_an_integer() -> None:
    bad = ["abc", "1.5", "-1", "", "+5", "5_0", " 5", "9999999999"]
    async with serve(admin_app(PRODUCTION)) as url:
        replies = [await get(url + f"/profz?seconds={urllib.parse.quote(s)}", ADMIN) for s in bad]
        duration = await get(url + "/profz?duration=x", ADMIN)
    for seconds, reply in zip(bad, replies, strict=True):
        assert reply.status == 400, seconds
        assert reply.json() == {"error": "seconds must be an integer (clamped to 1..60; default 5)"}
    assert duration.json() == {"error": "duration must be an integer (clamped to 1..60; default 5)"}


@pytest.mark.parametrize(
    ("raw", "seconds"), [(None, 5), ("0", 1), ("1", 1), ("60", 60), ("61", 60), ("100", 60)]
)
def test_profile_seconds_are_clamped_as_zero_clamps_them(raw: str | None, seconds: int) -> None:
    assert profile_seconds(raw) == seconds


async def test_profz_is_the_profile_zero_cache_fetches_and_takes_duration() -> None:
    async with serve(admin_app(PRODUCTION)) as url:
        denied = await get(url + "/profz")
        reply = await get(url + "/profz?duration=1&worker=change-streamer", ADMIN)
        other = await get(url + "/profz?seconds=1&worker=syncer", ADMIN)
    assert denied.status == 401
    assert denied.headers["WWW-Authenticate"] == 'Basic realm="Profz Protected Area"'
    assert reply.status == 200
    assert reply.headers["Content-Disposition"].endswith('.pstats"')
    assert marshal.loads(reply.body)  # pstats data: {function: stats}
    assert other.status == 404
    assert other.json() == {
        "error": "no profile from worker 'syncer': this process profiles 'change-streamer'"
    }


async def test_profile_checks_credentials_before_the_query() -> None:
    async with serve(admin_app(PRODUCTION)) as url:
        reply = await get(url + "/profile?seconds=0")
    assert reply.status == 401


async def test_a_second_profile_while_one_runs_is_409() -> None:
    profiler = LoopProfiler()
    app = admin_app(PRODUCTION, profiler=profiler)
    second, done = await second_while_first_runs(
        app, "/profile?seconds=1", lambda: profiler.busy, ADMIN
    )
    assert second.status == 409
    assert second.json() == {"error": "a profile is already being captured"}
    assert done.status == 200
    assert not profiler.busy


# -- /heapz ---------------------------------------------------------------------------


class _Held:
    """Objects a test allocates in a tracing window (found by their type's name)."""


async def test_heapz_counts_objects_by_type_and_asks_for_a_window() -> None:
    held = [_Held() for _ in range(5000)]
    async with serve(admin_app(PRODUCTION)) as url:
        denied = await get(url + "/heapz")
        reply = await get(url + "/heapz", ADMIN)
    assert denied.status == 401
    assert denied.headers["WWW-Authenticate"] == 'Basic realm="Heapz Protected Area"'
    assert reply.status == 200
    assert reply.headers.get_content_type() == "text/plain"
    lines = reply.text.splitlines()
    assert lines[0] == "=== objects by type (tracked by the garbage collector) ==="
    counted = [line for line in lines if line.endswith("  _Held")]
    assert counted
    assert int(counted[0].split()[0]) >= 5000
    assert "not traced: ask for a window with ?seconds=N (1 to 60)" in lines
    del held


async def test_heapz_window_shows_what_was_allocated_during_it_and_is_still_held() -> None:
    held: list[bytes] = []

    async def allocate() -> None:
        await eventually(tracemalloc.is_tracing, "the tracing window to open")
        held.extend(bytes(1000) + bytes([i % 256]) for i in range(2000))  # ~2 MB here

    async with serve(admin_app(PRODUCTION)) as url:
        allocating = asyncio.create_task(allocate())
        reply = await get(url + "/heapz?seconds=1", ADMIN)
        await allocating
    assert reply.status == 200
    text = reply.text
    assert "=== allocations still held, made since the last 1 s (tracemalloc) ===" in text
    ours = [line for line in text.splitlines() if "test_admin.py" in line]
    assert ours, text
    assert float(ours[0].split()[0]) > 1500  # KiB: the ~2 MB allocated above
    assert not tracemalloc.is_tracing()  # the window closed


async def test_heapz_dump_is_a_snapshot_tracemalloc_loads(tmp_path: Path) -> None:
    async with serve(admin_app(PRODUCTION)) as url:
        reply = await get(url + "/heapz?seconds=1&dump", ADMIN)
        bad = await get(url + "/heapz?seconds=x", ADMIN)
    assert reply.status == 200
    match = re.fullmatch(
        r'attachment; filename="(changestreamer-\d{8}T\d{6}Z\.tracemalloc)"',
        reply.headers["Content-Disposition"],
    )
    assert match is not None
    path = tmp_path / match.group(1)
    path.write_bytes(reply.body)
    snapshot = tracemalloc.Snapshot.load(str(path))
    assert snapshot.traceback_limit == 25
    assert bad.status == 400
    assert bad.json() == {"error": "seconds must be an integer (clamped to 1..60; default 0)"}


async def test_a_second_heap_window_while_one_is_open_is_409() -> None:
    tracer = HeapTracer()
    app = admin_app(PRODUCTION, heap=tracer)
    second, done = await second_while_first_runs(
        app, "/heapz?seconds=1", lambda: tracer.busy, ADMIN
    )
    assert second.status == 409
    assert second.json() == {"error": "a heap tracing window is already open"}
    assert done.status == 200


def test_the_replica_group_reads_the_file_without_writing_it(tmp_path: Path) -> None:
    from tests.replica.conftest import new_replica

    path = new_replica(tmp_path / "replica.db")
    before = path.read_bytes()
    stats = replica_file_stats(str(path))
    size = stats.pop("db file stats")
    assert size["size"] == len(before)
    assert size["walSize"] >= 0
    assert stats["file"] == str(path)
    assert stats["page size"] > 0
    assert stats["page count"] * stats["page size"] == len(before)
    assert stats["journal mode"] == "wal"
    assert (stats["replicaVersion"], stats["stateVersion"]) == ("01", "01")
    assert path.read_bytes() == before


async def test_only_the_groups_asked_for_are_computed(service: ChangeStreamerService) -> None:
    asked: list[frozenset[str] | None] = []

    async def counting(groups: frozenset[str] | None) -> dict[str, dict[str, Any]]:
        asked.append(groups)
        return await service_stats(service, groups)

    async with serve(admin_app(PRODUCTION, counting)) as url:
        reply = await get(url + "/statz?format=json&group=os,replication", ADMIN)
    assert list(reply.json()) == ["replication", "os"]
    assert asked == [frozenset({"os", "replication"})]
    assert list(await service_stats(service, frozenset({"upstream"}))) == ["upstream"]


async def test_a_heap_window_while_a_profile_runs_is_409_and_the_other_way_round() -> None:
    profiler, tracer = LoopProfiler(), HeapTracer()
    app = admin_app(PRODUCTION, profiler=profiler, heap=tracer)
    heap_during_profile, _ = await second_while_first_runs(
        app, "/profile?seconds=1", lambda: profiler.busy, ADMIN, second_path="/heapz"
    )
    profile_during_heap, _ = await second_while_first_runs(
        app, "/heapz?seconds=1", lambda: tracer.busy, ADMIN, second_path="/profz?seconds=1"
    )
    assert heap_during_profile.status == 409
    assert heap_during_profile.json() == {"error": "a profile is already being captured"}
    assert profile_during_heap.status == 409
    assert profile_during_heap.json() == {"error": "a heap tracing window is already open"}


@pytest.mark.parametrize("path", ["/profz?seconds=60", "/heapz?seconds=60"])
async def test_a_capture_ends_when_its_client_leaves(path: str) -> None:
    profiler, tracer = LoopProfiler(), HeapTracer()
    app = admin_app(PRODUCTION, profiler=profiler, heap=tracer)
    async with serve(app) as url:
        host, port = urllib.parse.urlsplit(url).netloc.split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {basic(ADMIN)}\r\n\r\n".encode()
        )
        await writer.drain()
        await eventually(lambda: profiler.busy or tracer.busy, "the capture started")
        writer.close()  # the client leaves long before the 60 s are up
        await eventually(
            lambda: not profiler.busy and not tracer.busy, "the capture ended", timeout_s=15
        )
        assert not tracemalloc.is_tracing()
        again = await get(url + "/profz?seconds=1", ADMIN)
    assert again.status == 200


async def test_statz_shows_the_backup_url_without_its_secrets(tmp_path: Path) -> None:
    secret_url = "s3://backup-user:hunter2@bucket/replica?access-key-id=AKIDSECRET&region=x"
    db, _source, svc = await new_service(tmp_path, task_id="t", backup_url=secret_url)
    try:
        groups = await service_stats(svc, frozenset({"backup"}))
    finally:
        svc.forwarder.close_all()
        await svc.storer.catchups.close()
        await db.dispose()
    shown = groups["backup"]["backupURL"]
    assert "hunter2" not in shown
    assert "AKIDSECRET" not in shown
    assert shown.startswith("s3://backup-user:***@bucket/replica?")
