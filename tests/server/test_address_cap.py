"""One client address cannot take the subscriber limit from everyone else (issue 43)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from tests.waiting import eventually

from .conftest import Server, start_server

QUERY = "replicaVersion=01&watermark=01"


@pytest.fixture
async def capped(tmp_path: Path) -> AsyncIterator[Server]:
    async for server in start_server(tmp_path, max_sockets_per_address=2):
        yield server


async def test_an_address_holds_at_most_its_sockets_whatever_the_endpoint(capped: Server) -> None:
    url = capped.url
    async with contextlib.AsyncExitStack() as held:
        sockets: list[ClientConnection] = [
            await held.enter_async_context(connect(f"{url}/replication/v6/changes?id=a&{QUERY}")),
            await held.enter_async_context(connect(f"{url}/replication/v7/subscribe")),
        ]
        for path in (f"/replication/v6/changes?id=c&{QUERY}", "/replication/v6/snapshot?taskID=t"):
            with pytest.raises(InvalidStatus) as refused:
                async with connect(url + path, open_timeout=10):
                    pass
            assert refused.value.response.status_code == 503
            assert b"at most 2 sockets from one address" in refused.value.response.body
        await sockets[0].close()

        async def accepted() -> bool:  # the closed one's place is free again
            with contextlib.suppress(InvalidStatus):
                async with connect(f"{url}/replication/v6/changes?id=d&{QUERY}", open_timeout=10):
                    return True
            return False

        assert await eventually(accepted, "a socket once one closed")
