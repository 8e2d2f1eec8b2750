"""The one-slot ack outbox: never blocks, keeps only the newest unsent item."""

from __future__ import annotations

import asyncio

import pytest

from app.sources.coalescing import CoalescingSender


class PausableSend:
    """A send that can be held, like a socket under back-pressure."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.started: list[str] = []
        self.open = asyncio.Event()
        self.open.set()

    async def __call__(self, item: str) -> None:
        self.started.append(item)
        await self.open.wait()
        self.sent.append(item)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_items_are_sent_in_order_when_the_writer_keeps_up() -> None:
    send = PausableSend()
    sender = CoalescingSender(send)
    task = asyncio.create_task(sender.run())
    for item in ("a", "b", "c"):
        sender.offer(item)
        await settle()
    task.cancel()
    assert send.sent == ["a", "b", "c"]
    assert sender.coalesced == 0


async def test_under_back_pressure_only_the_newest_pending_item_is_kept() -> None:
    send = PausableSend()
    send.open.clear()  # the socket is back-pressured
    sender = CoalescingSender(send)
    task = asyncio.create_task(sender.run())
    sender.offer("a")
    await settle()
    assert send.started == ["a"]  # "a" is being written and blocks
    sender.offer("b")
    sender.offer("c")
    sender.offer("d")
    assert (sender.pending, sender.coalesced) == ("d", 2)
    send.open.set()
    await settle()
    assert (send.sent, sender.pending) == (["a", "d"], None)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_offer_never_blocks_even_without_a_writer() -> None:
    sender = CoalescingSender(PausableSend())
    for i in range(10_000):
        sender.offer(str(i))
    assert sender.pending == "9999"


async def test_a_failing_send_ends_the_writer() -> None:
    async def broken(item: str) -> None:
        raise ConnectionError("gone")

    sender = CoalescingSender(broken)
    sender.offer("a")
    with pytest.raises(ConnectionError):
        await sender.run()
