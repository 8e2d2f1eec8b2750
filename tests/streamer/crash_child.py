"""A change-streamer process for the crash-safety test (run as a child, then SIGKILLed).

    python -m tests.streamer.crash_child CHANGE_DB EVENTS_FILE

It streams generated transactions as fast as the service takes them: transaction
n has watermark ``to_lexi(n)`` and ``1 + n % 5`` inserts, so the parent can check
any stored transaction for completeness. Every stream start and every upstream
ack is appended to EVENTS_FILE and flushed at once (the page cache survives a
SIGKILL of this process).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any, TextIO

from app.protocol.lexi import from_lexi, to_lexi
from app.protocol.messages import ChangeSourceMessage, parse_change_source_message
from app.sources.base import BackfillRequest, ChangeSource, ChangeStream
from app.storage import (
    Replication,
    Shard,
    create_change_db,
    parse_change_db_url,
)
from app.streamer.service import ChangeStreamerService
from tests.change_dbs import migrated

REPLICA_VERSION = "01"


def transaction(n: int) -> list[list[Any]]:
    w = to_lexi(n)
    rows = [
        [
            "data",
            {
                "tag": "insert",
                "relation": {"schema": "public", "name": "t", "rowKey": {"columns": ["id"]}},
                "new": {"id": f"{n}-{i}"},
            },
        ]
        for i in range(1 + n % 5)
    ]
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": w}],
        *rows,
        ["commit", {"tag": "commit"}, {"watermark": w}],
    ]


class GeneratingStream(ChangeStream):
    def __init__(self, after: str, events: TextIO) -> None:
        self._n = from_lexi(after) + 1
        self._events = events
        self._closed = False

    async def _generate(self) -> AsyncIterator[ChangeSourceMessage]:
        while not self._closed:
            for message in transaction(self._n):
                yield parse_change_source_message(message)
            self._n += 1
            if self._n % 50 == 0:
                await asyncio.sleep(0)

    def __aiter__(self) -> AsyncIterator[ChangeSourceMessage]:
        return self._generate()

    def ack(self, status: list[Any]) -> None:
        self._events.write(f"ack {status[2]['watermark']}\n")
        self._events.flush()

    async def close(self) -> None:
        self._closed = True


class GeneratingSource(ChangeSource):
    def __init__(self, events: TextIO) -> None:
        self._events = events

    async def start_stream(
        self, after_watermark: str, backfill_requests: list[BackfillRequest]
    ) -> ChangeStream:
        self._events.write(f"start {after_watermark}\n")
        self._events.flush()
        return GeneratingStream(after_watermark, self._events)


async def main(db_path: str, events_path: str) -> None:
    db = create_change_db(parse_change_db_url(db_path), Shard())
    await migrated(db, replica_version=REPLICA_VERSION)
    replication = Replication(db)
    state = await replication.state()
    assert state is not None
    with open(events_path, "a", encoding="utf-8") as events:  # noqa: ASYNC230 - set-up, once
        service = ChangeStreamerService(
            db=db,
            source=GeneratingSource(events),
            task_id="crash-child",
            address=None,
            replica_version=REPLICA_VERSION,
            durable_watermark=state.last_watermark,
        )
        events.write("ready\n")
        events.flush()
        await service.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
