"""Snapshot reservations: status, followup.subscribe, cancel, early loss, 1002."""

from __future__ import annotations

import asyncio

import pytest

from app.client import (
    ChangeStreamerClient,
    ProtocolError,
    SnapshotFollowup,
    SnapshotStatus,
    SubscriptionContext,
)
from app.protocol.subscription_messages import DownstreamStatus

from .conftest import REPLICA_VERSION, TIMEOUT, Server, txn, wait_until


async def reserve(
    server: Server, task_id: str = "t1", *, backed_up: str = "02"
) -> tuple[SnapshotStatus, SnapshotFollowup]:
    """Reserves; a backup at ``backed_up`` (which also opens the coverage gate, so
    the stream starts) confirms it, and the transaction there is stored."""
    client = ChangeStreamerClient(server.url)
    reserving = asyncio.create_task(client.reserve_snapshot(task_id))
    await wait_until(
        lambda: server.service.reservations.is_open(task_id), "the reservation to open"
    )
    server.service.backups.track(backed_up)
    stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
    if server.service.storer.durable < backed_up:
        stream.push_all(txn(backed_up))
        await asyncio.wait_for(server.service.storer.wait_durable(backed_up), TIMEOUT)
    return await asyncio.wait_for(reserving, TIMEOUT)


async def test_the_status_then_subscribing_ends_the_reservation(backup_server: Server) -> None:
    status, followup = await reserve(backup_server)
    assert status == SnapshotStatus(
        backup_url="file:///backups/r",
        replica_version=REPLICA_VERSION,
        min_watermark="02",
        body=status.body,
    )
    assert status.body["tag"] == "status"
    assert backup_server.service.reservations.reserved_watermarks() == ["02"]
    assert not followup.closed.is_set()

    ctx = SubscriptionContext("serving-replicator-1", REPLICA_VERSION, "02")
    async with await followup.subscribe(ctx) as sub:
        assert sub.ctx.task_id == "t1"
        assert sub.ctx.initial is True
        assert "taskID=t1" in sub.url
        assert "initial=true" in sub.url
        assert isinstance(await asyncio.wait_for(sub.__anext__(), TIMEOUT), DownstreamStatus)
        await asyncio.wait_for(followup.wait_closed(), TIMEOUT)
    assert not followup.aborted
    assert followup.close_error is None
    assert backup_server.service.reservations.reserved_watermarks() == []


async def test_cancel_closes_the_reservation_socket(backup_server: Server) -> None:
    _, followup = await reserve(backup_server)
    await asyncio.wait_for(followup.cancel(), TIMEOUT)
    await followup.cancel()  # idempotent
    assert followup.closed.is_set()
    assert not followup.aborted
    await wait_until(
        lambda: backup_server.service.reservations.reserved_watermarks() == [],
        "the server to drop the reservation",
    )


async def test_a_reservation_lost_before_subscribing_is_reported(backup_server: Server) -> None:
    _, first = await reserve(backup_server)
    # A second reservation for the same task replaces (and closes) the first.
    _, second = await reserve(backup_server)
    await asyncio.wait_for(first.wait_closed(), TIMEOUT)
    assert first.aborted
    assert not second.closed.is_set()
    await second.cancel()


async def test_without_backups_the_reservation_raises_protocol_error(server: Server) -> None:
    client = ChangeStreamerClient(server.url)
    with pytest.raises(ProtocolError) as e:
        await asyncio.wait_for(client.reserve_snapshot("t1"), TIMEOUT)
    assert e.value.reason == (
        "Error: replication-manager is not configured with a ZERO_LITESTREAM_BACKUP_URL"
    )
