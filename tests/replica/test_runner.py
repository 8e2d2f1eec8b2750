"""run_replicator end to end: our server (memory source) → loopback websocket → replica file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from app.backoff import Backoff
from app.client import ChangeStreamerClient, Subscription, SubscriptionContext
from app.replica.errors import ResyncRequiredError
from app.replica.runner import run_replicator
from app.replica.writer import CommitResult
from tests.server.conftest import REPLICA_VERSION, free_port, start_server

from .conftest import create_index, create_table, delete, insert, new_replica, rows, update


def tx(watermark: str, *changes: dict[str, Any]) -> list[list[Any]]:
    return [
        ["begin", {"tag": "begin", "json": "s"}, {"commitWatermark": watermark}],
        *(["data", c] for c in changes),
        ["commit", {"tag": "commit"}, {"watermark": watermark}],
    ]


class Commits:
    """Commit watermarks as the replicator reports them, awaitable."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._changed = asyncio.Event()

    def __call__(self, result: CommitResult) -> None:
        self.seen.append(result.watermark)
        self._changed.set()

    async def wait_for(self, watermark: str) -> None:
        async with asyncio.timeout(10):
            while watermark not in self.seen:
                self._changed.clear()
                await self._changed.wait()


async def test_replicates_over_a_real_websocket_and_survives_an_upstream_break(
    tmp_path: Path,
) -> None:
    replica = new_replica(tmp_path / "replica.db", REPLICA_VERSION)
    commits = Commits()
    stop = asyncio.Event()
    async for server in start_server(tmp_path):
        task = asyncio.create_task(
            run_replicator(
                server.url, str(replica), subscriber_id="hpc-replica", stop=stop, on_commit=commits
            )
        )
        try:
            stream = await asyncio.wait_for(server.source.wait_for_stream(), 10)
            stream.push_all(
                [
                    *tx("02", create_table(), create_index()),
                    *tx("03", insert({"id": 1, "name": "a"}), insert({"id": 2, "name": "b"})),
                    *tx("04", update({"id": 1, "name": "A"}), delete({"id": 2})),
                ]
            )
            await commits.wait_for("04")
            assert rows(replica, "SELECT * FROM foo ORDER BY id") == [(1, "A", "04")]

            # The upstream breaks mid-transaction: the server sends a rollback, the
            # source is restarted and resends the transaction whole.
            stream.push_all(tx("05", insert({"id": 3, "name": "c"}))[:-1])
            stream.fail(ConnectionError("upstream lost"))
            stream = await asyncio.wait_for(server.source.wait_for_stream(2), 10)
            assert stream.after_watermark == "04"
            stream.push_all(tx("05", insert({"id": 3, "name": "c"})))
            await commits.wait_for("05")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    assert commits.seen == ["02", "03", "04", "05"]
    assert rows(replica, "SELECT * FROM foo ORDER BY id") == [(1, "A", "04"), (3, "c", "05")]
    assert rows(replica, 'SELECT stateVersion FROM "_zero.replicationState"') == [("05",)]


async def test_a_replica_of_another_version_must_be_resynced(tmp_path: Path) -> None:
    replica = new_replica(tmp_path / "replica.db", "0a")
    async for server in start_server(tmp_path):
        with pytest.raises(ResyncRequiredError, match=r"must be re-synced: WrongReplicaVersion"):
            await asyncio.wait_for(
                run_replicator(
                    server.url, str(replica), subscriber_id="hpc-wrong", stop=asyncio.Event()
                ),
                10,
            )


class CountingClient(ChangeStreamerClient):
    def __init__(self, url: str, stop: asyncio.Event, attempts: int) -> None:
        super().__init__(url, open_timeout_s=1)
        self.contexts: list[SubscriptionContext] = []
        self._stop = stop
        self._attempts = attempts

    async def subscribe(self, ctx: SubscriptionContext) -> Subscription:
        self.contexts.append(ctx)
        if len(self.contexts) >= self._attempts:
            self._stop.set()
        return await super().subscribe(ctx)


async def test_connection_failures_are_retried_until_stopped(tmp_path: Path) -> None:
    replica = new_replica(tmp_path / "replica.db")
    stop = asyncio.Event()
    url = f"ws://127.0.0.1:{free_port()}"  # nothing listens there
    client = CountingClient(url, stop, attempts=3)
    await asyncio.wait_for(
        run_replicator(
            url,
            str(replica),
            subscriber_id="hpc-retry",
            stop=stop,
            client=client,
            backoff=Backoff(initial_s=0.01, max_s=0.02),
        ),
        10,
    )
    assert len(client.contexts) == 3
    assert {(c.replica_version, c.watermark, c.initial) for c in client.contexts} == {
        (REPLICA_VERSION, REPLICA_VERSION, True)
    }
