"""Liveness, readiness and the keepalive drain over real loopback HTTP (wire.md §2.1, §2.2)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI

from app.server.health import HealthRouter, KeepaliveMonitor, health_router

from .http import http_get, http_head, serve

# -- a real server on loopback -------------------------------------------------


# -- a clock and sleep the test drives -------------------------------------------


@dataclass
class ManualTime:
    now: float = 0.0
    sleeps: asyncio.Queue[tuple[float, asyncio.Future[None]]] = field(default_factory=asyncio.Queue)

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sleeps.put_nowait((seconds, wake))
        await wake

    async def next_sleep(self) -> tuple[float, asyncio.Future[None]]:
        return await asyncio.wait_for(self.sleeps.get(), 10)


def ready_app(router: HealthRouter) -> FastAPI:
    app = FastAPI()
    app.include_router(router)
    return app


def never_expires() -> None:
    raise AssertionError("the keepalive must not expire in this test")


# -- GET / and GET /keepalive -----------------------------------------------------


async def test_health_answers_200_ok_as_plain_text() -> None:
    router = health_router(
        ready=lambda: (True, ""), keepalive_timeout_s=None, on_keepalive_expired=never_expires
    )
    async with serve(ready_app(router)) as url:
        reply = await http_get(url + "/")
    assert (reply.status, reply.body) == (200, b"OK")
    assert reply.headers.get_content_type() == "text/plain"


async def test_keepalive_answers_ok_and_arms_nothing_without_a_timeout() -> None:
    router = health_router(
        ready=lambda: (True, ""), keepalive_timeout_s=None, on_keepalive_expired=never_expires
    )
    async with serve(ready_app(router)) as url:
        reply = await http_get(url + "/keepalive")
    assert (reply.status, reply.body) == (200, b"OK")
    assert router.keepalive_monitor is None


# -- GET /ready -------------------------------------------------------------------


async def test_ready_is_200_with_ready_true_when_the_check_passes() -> None:
    router = health_router(
        ready=lambda: (True, ""), keepalive_timeout_s=None, on_keepalive_expired=never_expires
    )
    async with serve(ready_app(router)) as url:
        reply = await http_get(url + "/ready")
    assert reply.status == 200
    assert reply.json() == {"ready": True}


async def test_ready_is_503_with_the_reason_while_not_ready() -> None:
    state = {"ready": False}

    def ready() -> tuple[bool, str]:
        return (True, "") if state["ready"] else (False, "waiting for the first backup")

    router = health_router(
        ready=ready, keepalive_timeout_s=None, on_keepalive_expired=never_expires
    )
    async with serve(ready_app(router)) as url:
        before = await http_get(url + "/ready")
        state["ready"] = True
        after = await http_get(url + "/ready")
    assert before.status == 503
    assert before.json() == {"ready": False, "reason": "waiting for the first backup"}
    assert after.status == 200


async def test_a_failing_readiness_check_reports_not_ready_with_the_error() -> None:
    def ready() -> tuple[bool, str]:
        raise RuntimeError("replica unreadable")

    router = health_router(
        ready=ready, keepalive_timeout_s=None, on_keepalive_expired=never_expires
    )
    async with serve(ready_app(router)) as url:
        reply = await http_get(url + "/ready")
    assert reply.status == 503
    assert reply.json() == {
        "ready": False,
        "reason": "readiness check failed: replica unreadable",
    }


# -- the keepalive monitor --------------------------------------------------------


async def test_keepalive_expires_once_after_the_timeout_without_heartbeats_not_before() -> None:
    time = ManualTime()
    expired: list[float] = []
    fired = asyncio.Event()

    def on_expired() -> None:
        expired.append(time.now)
        fired.set()

    router = health_router(
        ready=lambda: (True, ""),
        keepalive_timeout_s=20.0,
        on_keepalive_expired=on_expired,
        clock=time.clock,
        sleep=time.sleep,
    )
    async with serve(ready_app(router)) as url:
        assert (await http_get(url + "/keepalive")).status == 200  # at t=0: arms the monitor
        interval, wake = await time.next_sleep()
        assert interval == 5.0  # timeout / 4

        time.now = 19.9
        wake.set_result(None)
        _, wake = await time.next_sleep()  # checked, still alive: sleeps again
        assert expired == []

        time.now = 20.0
        wake.set_result(None)
        await asyncio.wait_for(fired.wait(), 10)
        assert expired == [20.0]
        monitor = router.keepalive_monitor
        assert monitor is not None
        assert monitor.expired
        for _ in range(5):
            await asyncio.sleep(0)
        assert time.sleeps.empty()  # the monitor ended: it fires once

        assert (await http_get(url + "/keepalive")).status == 200  # still answered
        for _ in range(5):
            await asyncio.sleep(0)
        assert time.sleeps.empty()  # and not re-armed
    assert expired == [20.0]


async def test_each_keepalive_restarts_the_timeout() -> None:
    time = ManualTime()
    expired: list[float] = []
    fired = asyncio.Event()

    def on_expired() -> None:
        expired.append(time.now)
        fired.set()

    router = health_router(
        ready=lambda: (True, ""),
        keepalive_timeout_s=20.0,
        on_keepalive_expired=on_expired,
        clock=time.clock,
        sleep=time.sleep,
    )
    async with serve(ready_app(router)) as url:
        await http_get(url + "/keepalive")  # t=0
        _, wake = await time.next_sleep()
        time.now = 15.0
        await http_get(url + "/keepalive")  # t=15
        wake.set_result(None)
        _, wake = await time.next_sleep()
        time.now = 34.9  # 19.9 s after the last heartbeat, 34.9 s after the first
        wake.set_result(None)
        _, wake = await time.next_sleep()
        assert expired == []
        time.now = 35.0
        wake.set_result(None)
        await asyncio.wait_for(fired.wait(), 10)
    assert expired == [35.0]


async def test_the_monitor_is_armed_only_by_the_first_keepalive() -> None:
    time = ManualTime()
    router = health_router(
        ready=lambda: (True, ""),
        keepalive_timeout_s=20.0,
        on_keepalive_expired=never_expires,
        clock=time.clock,
        sleep=time.sleep,
    )
    monitor = router.keepalive_monitor
    assert monitor is not None
    async with serve(ready_app(router)) as url:
        await http_get(url + "/")
        await http_get(url + "/ready")
        armed_before = monitor.armed
        await http_get(url + "/keepalive")
        armed_after = monitor.armed
        await time.next_sleep()
    assert (armed_before, armed_after) == (False, True)


async def test_app_shutdown_cancels_the_monitor_through_the_router_lifespan() -> None:
    time = ManualTime()
    router = health_router(
        ready=lambda: (True, ""),
        keepalive_timeout_s=20.0,
        on_keepalive_expired=never_expires,
        clock=time.clock,
        sleep=time.sleep,
    )
    async with serve(ready_app(router)) as url:
        await http_get(url + "/keepalive")
        _, wake = await time.next_sleep()
    assert wake.cancelled()
    monitor = router.keepalive_monitor
    assert monitor is not None
    assert not monitor.armed


async def test_a_stopped_monitor_is_not_rearmed_by_heartbeats() -> None:
    time = ManualTime()
    monitor = KeepaliveMonitor(20.0, never_expires, clock=time.clock, sleep=time.sleep)
    monitor.heartbeat()
    _, wake = await time.next_sleep()
    await monitor.stop()
    assert wake.cancelled()
    monitor.heartbeat()
    assert not monitor.armed
    assert time.sleeps.empty()


def test_a_non_positive_keepalive_timeout_is_rejected() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        KeepaliveMonitor(0, never_expires)


async def test_head_probes_get_the_status_of_get_and_no_body() -> None:
    state = {"ready": False}

    def ready() -> tuple[bool, str]:
        return (True, "") if state["ready"] else (False, "not yet")

    router = health_router(
        ready=ready, keepalive_timeout_s=None, on_keepalive_expired=never_expires
    )
    async with serve(ready_app(router)) as url:
        health = await http_head(url + "/")
        keepalive = await http_head(url + "/keepalive")
        not_ready = await http_head(url + "/ready")
        state["ready"] = True
        is_ready = await http_head(url + "/ready")
    assert [r.status for r in (health, keepalive, not_ready, is_ready)] == [200, 200, 503, 200]
    assert all(r.body == b"" for r in (health, keepalive, not_ready, is_ready))
