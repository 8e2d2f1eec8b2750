"""``changestreamer serve`` with ``ZERO_UPSTREAM_TYPE=custom`` against a custom change
source: a websocket server in the test (``custom_upstream``), the real console script
as a child process (``tests/serve_pg``'s :class:`Serve`), real SQLite files.

Covers spec/source.md §4: the initial sync into the replica file, streaming to a
subscriber (the Python client) with acks back to the source, a reconnect after the
source drops the socket, each watermark rule of §2.4 a source can break and a column
default that is not a literal (one clear line in serve's log, serve reconnects, nothing
of the transaction is stored), and the publications check on restart.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.client import ChangeStreamerClient, Subscription, SubscriptionContext
from app.protocol.messages import Begin, Commit, Data, Rollback
from tests.serve_pg.conftest import (
    APP_ID,
    Serve,
    change_db_watermark,
    eventually,
    lite_rows,
    replica_versions,
)
from tests.sources.custom_upstream import (
    Frame,
    create_table,
    custom_upstream,
    initial_sync,
    issue,
    transaction,
)

WAIT_S = 30.0
# The failed-stream lines are logged at INFO while the retry delay is short.
SERVE_ENV = {"ZERO_UPSTREAM_TYPE": "custom", "ZERO_LOG_LEVEL": "info"}

ServeMaker = Callable[..., Serve]


@pytest.fixture
def serves(tmp_path: Path) -> Iterator[ServeMaker]:
    """``make(url, **env)`` → a :class:`Serve` of a custom source (not started); all
    are killed after the test."""
    made: list[Serve] = []

    def make(url: str, workdir: Path | None = None, **env: str) -> Serve:
        where = workdir or tmp_path / f"serve{len(made)}"
        where.mkdir(parents=True, exist_ok=True)
        serve = Serve(where, url, {**SERVE_ENV, **env})
        made.append(serve)
        return serve

    yield make
    for serve in made:
        serve.close()


def subscription_context(replica_version: str, watermark: str) -> SubscriptionContext:
    return SubscriptionContext(id="test", replica_version=replica_version, watermark=watermark)


async def read_until_commit(sub: Subscription, watermark: str) -> list[Any]:
    """Messages (statuses left out) up to and including the commit at ``watermark``."""
    seen: list[Any] = []

    async def read() -> None:
        async for message in sub:
            if isinstance(message, Begin | Data | Commit | Rollback):
                seen.append(message)
            if isinstance(message, Commit) and message.watermark == watermark:
                return
        raise AssertionError(f"the subscription ended before commit {watermark}: {seen}")

    await asyncio.wait_for(read(), WAIT_S)
    return seen


async def read_messages(sub: Subscription, count: int) -> list[Any]:
    """The next ``count`` messages (statuses left out)."""
    seen: list[Any] = []

    async def read() -> None:
        async for message in sub:
            if isinstance(message, Begin | Data | Commit | Rollback):
                seen.append(message)
                if len(seen) == count:
                    return
        raise AssertionError(f"the subscription ended after {seen}")

    await asyncio.wait_for(read(), WAIT_S)
    return seen


def shape(messages: list[Any]) -> list[tuple[str, str]]:
    """(kind, watermark or data tag) of each message."""
    out: list[tuple[str, str]] = []
    for m in messages:
        if isinstance(m, Begin):
            out.append(("begin", m.commit_watermark))
        elif isinstance(m, Commit):
            out.append(("commit", m.watermark))
        elif isinstance(m, Data):
            out.append(("data", m.tag))
        else:
            out.append(("rollback", ""))
    return out


def stored(serve: Serve) -> list[tuple[str, int]]:
    """The change log's (watermark, pos) rows, in order."""
    rows = lite_rows(
        serve.change_db_file, 'SELECT watermark, pos FROM "changeLog" ORDER BY watermark, pos'
    )
    return [(w, p) for w, p in rows]


def issues(replica: Path) -> list[tuple[Any, ...]]:
    return lite_rows(replica, 'SELECT id, title, "_0_version" FROM issues ORDER BY id')


async def ready(up_url: str, serves: ServeMaker, **env: str) -> Serve:
    serve = serves(up_url, **env)
    serve.start()
    await serve.wait_ready()
    return serve


# -- initial sync, streaming, acks -----------------------------------------------------


async def test_initial_sync_then_streaming_to_a_subscriber_with_acks(serves: ServeMaker) -> None:
    async with custom_upstream([initial_sync(APP_ID, "0a")]) as up:
        serve = await ready(up.url, serves, ZERO_APP_PUBLICATIONS="pub_b,pub_a")

        # The initial sync: the first transaction is the replica, at its watermark.
        assert replica_versions(serve.replica_file) == ("0a", "0a")
        assert issues(serve.replica_file) == [(i, f"issue {i}", "0a") for i in (1, 2, 3)]
        pubs = lite_rows(serve.replica_file, 'SELECT publications FROM "_zero.replicationConfig"')
        assert pubs == [('["pub_a","pub_b"]',)]
        (sync,) = up.initial_syncs
        assert "lastWatermark" not in sync
        assert "replicaVersion" not in sync
        assert (sync["apiKey"], sync["appID"], sync["shardNum"], sync["publications"]) == (
            ["k"],
            [APP_ID],
            ["0"],
            ["pub_a", "pub_b"],
        )

        # Streaming starts at the replica version; the change log is tied to it.
        await eventually(lambda: up.streams, "a streaming connection", WAIT_S)
        (stream,) = up.streams
        assert (stream["lastWatermark"], stream["replicaVersion"]) == (["0a"], ["0a"])
        assert stream["publications"] == ["pub_a", "pub_b"]
        assert stored(serve) == [("0a", 0), ("0a", 1)]

        client = ChangeStreamerClient(f"ws://127.0.0.1:{serve.port}")
        async with await client.subscribe(subscription_context("0a", "0a")) as sub:
            up.publish(transaction("0b", issue(4, "four")))
            update = {
                "tag": "update",
                "relation": {"schema": "public", "name": "issues", "rowKey": {"columns": ["id"]}},
                "key": None,
                "new": {"id": 1, "title": "one, renamed"},
            }
            up.publish(transaction("0c", update))
            seen = await read_until_commit(sub, "0c")
        assert shape(seen) == [
            ("begin", "0b"),
            ("data", "insert"),
            ("commit", "0b"),
            ("begin", "0c"),
            ("data", "update"),
            ("commit", "0c"),
        ]
        assert seen[1].body["new"] == {"id": 4, "title": "four"}

        # Acks reach the source once the commits are durable, echoing each commit.
        await eventually(lambda: "0c" in up.acked(), "the ack of 0c", WAIT_S)
        assert up.acks[-1] == ["status", {"tag": "commit"}, {"watermark": "0c"}]
        assert up.acked() == sorted(up.acked())
        assert "0a" not in up.acked()  # the initial transaction is never acked

        # The replica file follows the change log.
        await eventually(
            lambda: replica_versions(serve.replica_file)[1] == "0c", "replica at 0c", WAIT_S
        )
        assert issues(serve.replica_file) == [
            (1, "one, renamed", "0c"),
            (2, "issue 2", "0a"),
            (3, "issue 3", "0a"),
            (4, "four", "0b"),
        ]
        await serve.terminate()


async def test_a_dropped_socket_resumes_after_the_last_stored_commit(serves: ServeMaker) -> None:
    async with custom_upstream([initial_sync(APP_ID, "0a")]) as up:
        up.publish(transaction("0b", issue(4, "four")))
        serve = await ready(up.url, serves)
        client = ChangeStreamerClient(f"ws://127.0.0.1:{serve.port}")
        async with await client.subscribe(subscription_context("0a", "0a")) as sub:
            assert shape(await read_until_commit(sub, "0b"))[-1] == ("commit", "0b")
            await eventually(lambda: change_db_watermark(serve.change_db_file) == "0b", "0b")

            # Half a transaction reaches the subscriber, then the source drops the
            # TCP connection.
            await up.send_now(transaction("0c", issue(5, "five"))[:-1])
            partial = await read_messages(sub, 2)
            up.drop()
            await eventually(lambda: len(up.streams) == 2, "a second connection", WAIT_S)
            second = up.streams[1]
            assert (second["lastWatermark"], second["replicaVersion"]) == (["0b"], ["0a"])
            up.publish(transaction("0c", issue(5, "five")))
            seen = partial + await read_until_commit(sub, "0c")

        # The partial 0c was rolled back; the whole one came once; nothing else repeated.
        assert shape(seen) == [
            ("begin", "0c"),
            ("data", "insert"),
            ("rollback", ""),
            ("begin", "0c"),
            ("data", "insert"),
            ("commit", "0c"),
        ]
        await eventually(lambda: change_db_watermark(serve.change_db_file) == "0c", "0c stored")
        assert stored(serve) == [
            ("0a", 0),
            ("0a", 1),
            *[("0b", p) for p in range(3)],
            *[("0c", p) for p in range(3)],
        ]
        await eventually(lambda: "0c" in up.acked(), "the ack of 0c", WAIT_S)
        await eventually(
            lambda: replica_versions(serve.replica_file)[1] == "0c", "replica at 0c", WAIT_S
        )
        assert [row[0] for row in issues(serve.replica_file)] == [1, 2, 3, 4, 5]
        await serve.terminate()


# -- the watermark rules (spec/source.md §2.4) -----------------------------------------


def _with_backfill(tx: list[Frame]) -> list[Frame]:
    (change,) = create_table("public", "more", {"id": "int4"}, ["id"])[:1]
    return [tx[0], ["data", {**change, "backfill": {"id": {"attNum": 1}}}], tx[-1]]


def _injected_default(watermark: str) -> list[Frame]:
    """An add-column whose default carries SQL (issue 25), after a good change."""
    spec = {"pos": 3, "dataType": "text", "dflt": INJECTED_DEFAULT}
    add = {"tag": "add-column", "table": {"schema": "public", "name": "issues"}}
    return transaction(watermark, issue(6, "six"), {**add, "column": {"name": "c", "spec": spec}})


INJECTED_DEFAULT = "'x'; DROP TABLE issues; SELECT 'y'::text"


def _mismatched(watermark: str, commit: str) -> list[Frame]:
    tx = transaction(watermark, issue(6, "six"))
    return [*tx[:-1], ["commit", {"tag": "commit"}, {"watermark": commit}]]


# The frames a misbehaving source sends on a stream started at lastWatermark 0b, the
# error text serve's log must show, and the last commit stored before the violation.
VIOLATIONS = {
    "invalid LexiVersion": (
        [["begin", {"tag": "begin"}, {"commitWatermark": "0C"}]],
        "sent an invalid change-source message: begin: field 'commitWatermark' is not a "
        "valid watermark: invalid LexiVersion '0C'",
        "0b",
    ),
    "commit not after the previous one": (
        [*transaction("0d", issue(6, "six")), *transaction("0c", issue(7, "seven"))],
        "sent a begin with commitWatermark 0c, not after the previous commit 0d "
        "(commit watermarks must strictly increase)",
        "0d",
    ),
    "commit not after lastWatermark": (
        transaction("0b", issue(6, "six")),
        "sent a begin with commitWatermark 0b, not after lastWatermark 0b the stream was "
        "started with (it is stored already)",
        "0b",
    ),
    "begin/commit mismatch": (
        _mismatched("0c", "0d"),
        "sent a commit with watermark 0d, not its begin's commitWatermark 0c",
        "0b",
    ),
    "status going backwards": (
        [
            ["status", {"ack": True}, {"watermark": "0e"}],
            ["status", {"ack": True}, {"watermark": "0d"}],
        ],
        "sent a status with watermark 0d, behind the status watermark 0e sent before it "
        "(watermarks never go backwards)",
        "0b",
    ),
    "backfill field": (
        _with_backfill(transaction("0c")),
        "sent a create-table of public.more with a 'backfill' field (custom change sources "
        "cannot backfill: leave it out and send the rows)",
        "0b",
    ),
    "column default not a literal": (
        _injected_default("0c"),
        f"sent an add-column of public.issues whose column c has the default {INJECTED_DEFAULT}, "
        "not a literal (a column default must be a number, true, false, a quoted string "
        "with a ::type cast such as 'x'::text, an empty array, or null)",
        "0b",
    ),
}


@pytest.mark.parametrize("case", list(VIOLATIONS))
async def test_a_broken_watermark_rule_is_one_line_and_serve_reconnects(
    serves: ServeMaker, case: str
) -> None:
    frames, error, last_good = VIOLATIONS[case]
    async with custom_upstream([initial_sync(APP_ID, "0a")]) as up:
        up.publish(transaction("0b", issue(4, "four")))
        serve = await ready(up.url, serves)
        await eventually(lambda: change_db_watermark(serve.change_db_file) == "0b", "0b stored")
        # The next connection (lastWatermark 0b) misbehaves, once.
        up.next_stream(frames)
        up.drop()
        line = await serve.wait_output(re.escape(error), WAIT_S)
        assert "change stream failed (custom change source ws://127.0.0.1:" in line
        assert "/changes/v0/stream sent " in line
        assert "apiKey" not in line  # the query may hold a secret
        assert line.rstrip().endswith("s")  # "...; retrying in 0.025s": all on one line

        # serve reconnects after what it stored; nothing of the broken transaction is kept.
        await eventually(lambda: len(up.streams) == 3, "a third connection", WAIT_S)
        third = up.streams[2]
        assert (third["lastWatermark"], third["replicaVersion"]) == ([last_good], ["0a"])
        up.publish(transaction("0z", issue(9, "nine")))
        await eventually(lambda: change_db_watermark(serve.change_db_file) == "0z", "0z stored")
        assert {w for w, _ in stored(serve)} == {"0a", "0b", last_good, "0z"}
        # The replica's tables are as they were, and take rows.
        await eventually(
            lambda: replica_versions(serve.replica_file)[1] == "0z", "replica at 0z", WAIT_S
        )
        columns = lite_rows(serve.replica_file, "SELECT name FROM pragma_table_info('issues')")
        assert [name for (name,) in columns] == ["id", "title", "_0_version"]
        assert [row[0] for row in issues(serve.replica_file)][-1] == 9
        assert serve.alive()
        assert sum(error in text for text in serve.output().splitlines()) == 1
        await serve.terminate()


# -- restarts --------------------------------------------------------------------------


async def test_a_restart_keeps_the_replica_and_streams_on(serves: ServeMaker) -> None:
    async with custom_upstream([initial_sync(APP_ID, "0a"), initial_sync(APP_ID, "0x")]) as up:
        up.publish(transaction("0b", issue(4, "four")))
        serve = await ready(up.url, serves, ZERO_APP_PUBLICATIONS="p")
        await eventually(lambda: change_db_watermark(serve.change_db_file) == "0b", "0b stored")
        await serve.terminate()
        serve.start()
        await serve.wait_ready()
        await eventually(lambda: len(up.streams) == 2, "a second connection", WAIT_S)
        assert len(up.initial_syncs) == 1  # no second initial sync
        assert (up.streams[1]["lastWatermark"], up.streams[1]["replicaVersion"]) == (
            ["0b"],
            ["0a"],
        )
        await serve.terminate()


async def test_other_publications_on_restart_stop_serve_with_one_line(
    serves: ServeMaker,
) -> None:
    async with custom_upstream([initial_sync(APP_ID, "0a")]) as up:
        serve = await ready(up.url, serves, ZERO_APP_PUBLICATIONS="b,a")
        await serve.terminate()
        serve.env["ZERO_APP_PUBLICATIONS"] = "a,c"
        serve.start()
        assert await serve.wait_exit() == 1
        errors = [
            line for line in serve.output().splitlines() if line.startswith("changestreamer:")
        ]
        assert errors == [
            f"changestreamer: replica {serve.replica_file}: ZERO_APP_PUBLICATIONS ['a', 'c'] "
            "do not match the publications the replica was synced with ['a', 'b']; set "
            "ZERO_APP_PUBLICATIONS back, or delete the replica file to re-sync"
        ]
        assert len(up.initial_syncs) == 1


async def test_a_reset_required_during_the_initial_sync_syncs_again(serves: ServeMaker) -> None:
    reset: list[Frame] = [["control", {"tag": "reset-required", "message": "not yet"}]]
    async with custom_upstream([reset, initial_sync(APP_ID, "0f")]) as up:
        serve = await ready(up.url, serves)
        assert len(up.initial_syncs) == 2
        assert replica_versions(serve.replica_file) == ("0f", "0f")
        await serve.wait_output("the change source requires a reset during the initial sync")
        await serve.terminate()


async def test_a_reset_required_while_streaming_syncs_a_new_replica(serves: ServeMaker) -> None:
    resynced = initial_sync(APP_ID, "0x", issues=5)
    async with custom_upstream([initial_sync(APP_ID, "0a"), resynced]) as up:
        up.publish(transaction("0b", issue(4, "four")))
        serve = await ready(up.url, serves)
        await eventually(lambda: change_db_watermark(serve.change_db_file) == "0b", "0b stored")
        up.next_stream([["control", {"tag": "reset-required", "message": "history lost"}]])
        up.drop()
        await eventually(lambda: len(up.initial_syncs) == 2, "a second initial sync", WAIT_S)
        await eventually(
            lambda: up.streams[-1]["replicaVersion"] == ["0x"], "a stream of 0x", WAIT_S
        )
        assert up.streams[-1]["lastWatermark"] == ["0x"]
        await serve.wait_ready()
        assert replica_versions(serve.replica_file)[0] == "0x"
        assert [row[0] for row in issues(serve.replica_file)] == [1, 2, 3, 4, 5]
        assert stored(serve) == [("0x", 0), ("0x", 1)]  # the change log starts over
        await serve.terminate()


async def test_a_failed_initial_sync_stops_serve_with_one_line(serves: ServeMaker) -> None:
    rollback: list[Frame] = [*transaction("0a")[:1], ["rollback", {"tag": "rollback"}]]
    async with custom_upstream([rollback]) as up:
        serve = serves(up.url)
        serve.start()
        assert await serve.wait_exit() == 1
        errors = [
            line for line in serve.output().splitlines() if line.startswith("changestreamer:")
        ]
        assert errors == [
            "changestreamer: initial sync failed: unexpected message during the initial sync "
            '(it must be one transaction: begin, data..., commit): ["rollback",{"tag":"rollback"}]'
        ]
        assert not serve.replica_file.exists()
